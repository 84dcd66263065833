"""Triton kernels against their torch references and naive block-table walks.

On CPU they run under the Triton interpreter (TRITON_INTERPRET=1, set in conftest before
triton is imported); tests marked `gpu` run the compiled kernels and skip without CUDA.
Outputs are poisoned with NaN before every launch and checked to be fully written.
The interpreter computes bf16 arithmetic wrongly without an error, so CPU cases use
fp32 and fp16 (fp32 inputs are multiplied in full fp32; 16-bit ones go to tl.dot as they
are, accumulating in fp32, with the softmax weights rounded to the value dtype).
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_ref import naive_attention, random_tables, walk

from kernels import (
    pack_blocks,
    pack_blocks_ref,
    paged_gqa_decode,
    paged_gqa_decode_ref,
    paged_mla_decode,
    paged_mla_decode_ref,
    unpack_blocks,
    unpack_blocks_ref,
    write_kv,
    write_kv_ref,
)

# fp32: kernel and reference sum in different orders, ~1e-6 relative.
# fp16: inputs identical, products accumulated in fp32 in both; the kernel rounds the softmax
# weights and the output to fp16 (~1e-3 relative).
TOLERANCES = {torch.float32: dict(atol=3e-5, rtol=3e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def ctx_cases(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]


GQA_CASES = [
    # (block_size, num_q_heads, num_kv_heads, head_dim, num_splits)
    (16, 4, 4, 64, 1),  # group 1, split-KV off
    (16, 8, 2, 64, 3),  # group 4, split-KV on
    (64, 8, 1, 128, 1),  # group 8, head dim 128
    (64, 8, 1, 128, 2),
    (16, 4, 2, 40, 2),  # non-power-of-two head dim
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size,hq,hkv,dim,splits", GQA_CASES)
def test_paged_gqa_decode(block_size, hq, hkv, dim, splits, dtype):
    gen = torch.Generator().manual_seed(block_size * 100 + hq * 10 + dim + splits)
    ctx = ctx_cases(block_size)
    nblocks = 4 * len(ctx) + 4
    k_cache = torch.randn(nblocks, block_size, hkv, dim, generator=gen).to(dtype)
    v_cache = torch.randn(nblocks, block_size, hkv, dim, generator=gen).to(dtype)
    table = random_tables(ctx, block_size, nblocks, gen)
    q = torch.randn(len(ctx), hq, dim, generator=gen).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32)
    out = torch.full((len(ctx), hq, dim), float("nan"), dtype=dtype)
    paged_gqa_decode(q, k_cache, v_cache, table, lens, dim**-0.5, num_splits=splits, out=out)
    assert not out.isnan().any(), "output not fully written"
    ref = paged_gqa_decode_ref(q, k_cache, v_cache, table, lens, dim**-0.5)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])
    for i in (0, len(ctx) - 1):  # the naive walk on the shortest and longest context
        naive = naive_attention(
            q[i].float(),
            walk(k_cache.float(), table[i], ctx[i], block_size),
            walk(v_cache.float(), table[i], ctx[i], block_size),
            dim**-0.5,
        )
        torch.testing.assert_close(out[i].float(), naive, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [16, 32, 128])
@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_tiles_of_any_width_agree_with_the_reference(tokens, block_size, dtype):
    """A loop step of fewer tokens than a KV block, as many, or several blocks' worth, with
    split-KV boundaries inside a step: the same result as the reference, GQA and MLA."""
    gen = torch.Generator().manual_seed(tokens + block_size)
    ctx = [*ctx_cases(block_size), 7 * block_size + 3]
    nblocks = 8 * len(ctx) + 4
    table = random_tables(ctx, block_size, nblocks, gen)
    lens = torch.tensor(ctx, dtype=torch.int32)
    k_cache = torch.randn(nblocks, block_size, 2, 64, generator=gen).to(dtype)
    v_cache = torch.randn(nblocks, block_size, 2, 64, generator=gen).to(dtype)
    q = torch.randn(len(ctx), 8, 64, generator=gen).to(dtype)
    for splits in (1, 3):
        out = paged_gqa_decode(
            q, k_cache, v_cache, table, lens, 0.125, num_splits=splits, tokens_per_step=tokens
        )
        ref = paged_gqa_decode_ref(q, k_cache, v_cache, table, lens, 0.125)
        torch.testing.assert_close(out, ref, **TOLERANCES[dtype])
    latent = torch.randn(nblocks, block_size, 64 + 16, generator=gen).to(dtype)
    q_latent = torch.randn(len(ctx), 4, 64, generator=gen).to(dtype)
    q_pe = torch.randn(len(ctx), 4, 16, generator=gen).to(dtype)
    out = paged_mla_decode(
        q_latent, q_pe, latent, table, lens, 0.1, num_splits=2, tokens_per_step=tokens
    )
    ref = paged_mla_decode_ref(q_latent, q_pe, latent, table, lens, 0.1)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


def test_decode_tile_width_must_be_a_power_of_two():
    q, k = torch.zeros(1, 2, 16), torch.zeros(2, 16, 1, 16)
    table, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    for bad in (8, 48):
        with pytest.raises(ValueError, match="power of two >= 16"):
            paged_gqa_decode(q, k, k, table, lens, 1.0, tokens_per_step=bad)


def test_paged_gqa_decode_soft_cap():
    gen = torch.Generator().manual_seed(7)
    ctx = [5, 40]
    k_cache = torch.randn(8, 16, 2, 32, generator=gen) * 3
    v_cache = torch.randn(8, 16, 2, 32, generator=gen)
    table = random_tables(ctx, 16, 8, gen)
    q = torch.randn(2, 4, 32, generator=gen) * 3
    lens = torch.tensor(ctx, dtype=torch.int32)
    out = paged_gqa_decode(q, k_cache, v_cache, table, lens, 0.5, soft_cap=5.0, num_splits=2)
    ref = paged_gqa_decode_ref(q, k_cache, v_cache, table, lens, 0.5, soft_cap=5.0)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    plain = paged_gqa_decode_ref(q, k_cache, v_cache, table, lens, 0.5)
    assert (out - plain).abs().max() > 1e-3  # the cap changed the result


MLA_CASES = [
    # (block_size, heads, kv_lora_rank, rope_dim, num_splits)
    (16, 4, 32, 8, 1),  # small
    (16, 20, 64, 16, 3),  # heads over one BLOCK_H group, split-KV on
    (64, 16, 512, 64, 2),  # DeepSeek's latent shape (few heads keeps the interpreter fast)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size,heads,rank,rope,splits", MLA_CASES)
def test_paged_mla_decode(block_size, heads, rank, rope, splits, dtype):
    gen = torch.Generator().manual_seed(rank + heads + splits)
    ctx = ctx_cases(block_size)
    nblocks = 4 * len(ctx) + 4
    latent = torch.randn(nblocks, block_size, rank + rope, generator=gen).to(dtype)
    table = random_tables(ctx, block_size, nblocks, gen)
    q_latent = torch.randn(len(ctx), heads, rank, generator=gen).to(dtype)
    q_pe = torch.randn(len(ctx), heads, rope, generator=gen).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32)
    scale = (rank + rope) ** -0.5
    out = torch.full_like(q_latent, float("nan"))
    paged_mla_decode(q_latent, q_pe, latent, table, lens, scale, num_splits=splits, out=out)
    assert not out.isnan().any(), "output not fully written"
    ref = paged_mla_decode_ref(q_latent, q_pe, latent, table, lens, scale)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])
    i = len(ctx) - 1
    rows = walk(latent.float(), table[i], ctx[i], block_size)
    q = torch.cat([q_latent[i], q_pe[i]], dim=-1).float()
    naive = naive_attention(q, rows[:, None, :], rows[:, None, :rank], scale)
    torch.testing.assert_close(out[i].float(), naive, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("entry", [(2, 64), (4, 40), (72,)])
def test_write_kv(entry, dtype):
    gen = torch.Generator().manual_seed(len(entry))
    cache = torch.full((6, 16, *entry), float("nan"), dtype=dtype)
    expected = cache.clone()
    slots = torch.randperm(96, generator=gen)[:11]
    slots[[3, 7]] = -1  # padding tokens (a CUDA graph's spare rows): not written
    new = torch.randn(11, *entry, generator=gen).to(dtype)
    write_kv(cache, new, slots)
    write_kv_ref(expected, new[slots >= 0], slots[slots >= 0])  # the reference: real slots only
    assert torch.equal(cache.isnan(), expected.isnan())
    assert (~cache.isnan()).flatten(2).any(-1).sum() == 9  # 9 slots written, not 11
    torch.testing.assert_close(cache, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("layout", ["gqa", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pack_unpack_round_trip_is_bit_exact(layout, dtype):
    gen = torch.Generator().manual_seed(3)
    if layout == "gqa":
        shape, block_dim = (3, 2, 20, 16, 2, 8), 2
    else:
        shape, block_dim = (3, 20, 16, 24), 1
    pool = torch.randn(shape, generator=gen).to(dtype)
    for n in (1, 5, 20):
        ids = torch.randperm(20, generator=gen)[:n]
        staging = pack_blocks(pool, ids, block_dim)
        assert torch.equal(staging, pack_blocks_ref(pool, ids, block_dim))
        target = torch.full_like(pool, float("nan"))
        unpack_blocks(target, ids, staging, block_dim)
        expected = torch.full_like(pool, float("nan"))
        unpack_blocks_ref(expected, ids, staging, block_dim)
        assert torch.equal(target.isnan(), expected.isnan())
        moved = target.index_select(block_dim, ids)
        assert torch.equal(moved, pool.index_select(block_dim, ids))  # bit-exact


def test_pack_rejects_duplicates_and_handles_empty_lists():
    pool = torch.randn(2, 2, 8, 16, 1, 4)
    with pytest.raises(ValueError, match=r"duplicate block ids \[3\]"):
        pack_blocks(pool, torch.tensor([1, 3, 3]), 2)
    with pytest.raises(ValueError, match="duplicate"):
        unpack_blocks(pool, torch.tensor([2, 2]), torch.zeros(2, 4, 64), 2)
    with pytest.raises(ValueError, match=r"must lie in \[0, 8\)"):
        pack_blocks(pool, torch.tensor([8]), 2)
    empty = pack_blocks(pool, torch.tensor([], dtype=torch.long), 2)
    assert empty.shape == (0, 4, 64)
    before = pool.clone()
    unpack_blocks(pool, torch.tensor([], dtype=torch.long), empty, 2)
    assert torch.equal(pool, before)


def test_launch_errors_are_clear():
    q = torch.randn(1, 4, 16)
    cache = torch.randn(4, 8, 2, 16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="power of two >= 16"):
        paged_gqa_decode(q, cache, cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="int32 or int64"):
        paged_gqa_decode(q, cache, cache, table.float(), lens, 1.0)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek"])
def test_engine_triton_backend_matches_torch_backend(model):
    from pdserve import LLM, SamplingParams

    prompts = [[5] * 1, [7, 8, 9] * 6, list(range(40, 90))]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    torch_out = LLM(model, attention_backend="torch").generate(prompts, params)
    llm = LLM(model, attention_backend="triton")
    triton_out = llm.generate(prompts, params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]
    llm.check_integrity()


# -- compiled kernels on a GPU ---------------------------------------------------------------

GPU_TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [None, 16, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_gpu_gqa_and_mla_decode(dtype, splits, tokens):
    gen = torch.Generator(device="cuda").manual_seed(0)
    ctx = torch.tensor([1, 15, 16, 17, 1000, 4097], dtype=torch.int32, device="cuda")
    n = len(ctx)
    bs, nblocks = 16, 1600  # 6 sequences x 260 blocks, shuffled
    table = torch.randperm(nblocks, device="cuda", generator=gen)[: n * 260].view(n, 260)
    table = table.to(torch.int32)
    k = torch.randn(nblocks, bs, 8, 128, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(nblocks, bs, 8, 128, device="cuda", dtype=dtype, generator=gen)
    q = torch.randn(n, 64, 128, device="cuda", dtype=dtype, generator=gen)
    kw = dict(num_splits=splits, tokens_per_step=tokens)
    out = paged_gqa_decode(q, k, v, table, ctx, 128**-0.5, **kw)
    ref = paged_gqa_decode_ref(q, k, v, table, ctx, 128**-0.5)
    torch.testing.assert_close(out, ref, **GPU_TOL[dtype])
    latent = torch.randn(nblocks, bs, 576, device="cuda", dtype=dtype, generator=gen)
    ql = torch.randn(n, 16, 512, device="cuda", dtype=dtype, generator=gen)
    qp = torch.randn(n, 16, 64, device="cuda", dtype=dtype, generator=gen)
    out = paged_mla_decode(ql, qp, latent, table, ctx, 576**-0.5, **kw)
    ref = paged_mla_decode_ref(ql, qp, latent, table, ctx, 576**-0.5)
    torch.testing.assert_close(out, ref, **GPU_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("ids_on", ["cuda", "cpu"])  # host ids: checked there, copied over
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_write_and_block_copy(dtype, ids_on):
    pool = torch.randn(4, 2, 64, 16, 8, 128, device="cuda", dtype=dtype)
    ids = torch.randperm(64, device="cuda")[:17].to(ids_on)
    staging = pack_blocks(pool, ids, 2)
    assert torch.equal(staging, pack_blocks_ref(pool, ids, 2))
    target = torch.zeros_like(pool)
    unpack_blocks(target, ids, staging, 2)
    on_gpu = ids.cuda()
    assert torch.equal(target.index_select(2, on_gpu), pool.index_select(2, on_gpu))
    cache = torch.zeros(64, 16, 8, 128, device="cuda", dtype=dtype)
    expected = cache.clone()
    slots = torch.randperm(1024, device="cuda")[:100]
    new = torch.randn(100, 8, 128, device="cuda", dtype=dtype)
    write_kv(cache, new, slots)
    write_kv_ref(expected, new, slots)
    assert torch.equal(cache, expected)


def test_bench_kernels_tile_sweep_times_and_checks_every_tile():
    """`bench kernels --tiles` rows: every tile of each decode case (for MLA also stages and
    splits), timed and compared with the reference (under the interpreter here; compiled
    on a GPU)."""
    from pdserve.bench.kernels import (
        MLA_TILE_SPLITS,
        MLA_TILE_STAGES,
        TILE_TOKENS,
        TILE_WARPS,
        gqa_cases,
        mla_cases,
        tile_rows,
    )

    cpu = torch.device("cpu")
    cases = gqa_cases([2], [40], [(4, 2, 16)], torch.float32, cpu, 16)
    cases += mla_cases([2], [40], 4, 32, 16, torch.float32, cpu, 16)
    rows = tile_rows(cases, cpu, bandwidth=1e9)
    plain = {(t, w, None, None) for t in TILE_TOKENS for w in TILE_WARPS}
    staged = {(t, w, s, None) for t in (32, 64) for w in TILE_WARPS for s in MLA_TILE_STAGES}
    split = {(64, 8, None, n) for n in MLA_TILE_SPLITS}
    seen = {
        k: [(r["tokens"], r["warps"], r["stages"], r["splits"]) for r in rows if r["kernel"] == k]
        for k in ("gqa_decode", "mla_decode")
    }
    assert sorted(seen["gqa_decode"], key=str) == sorted(plain, key=str)
    assert sorted(seen["mla_decode"], key=str) == sorted(plain | staged | split, key=str)
    for r in rows:
        assert "error" not in r, r
        assert r["triton_s"] > 0 and r["max_abs_diff_vs_torch"] < 1e-4, r


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_prefill_attention_sdpa_matches_the_reference(dtype):
    from kernels import prefill_attention_ref, prefill_attention_sdpa

    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(200, 16, 8, 128, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(200, 16, 8, 128, device="cuda", dtype=dtype, generator=gen)
    ctx, q_lens = [1000, 300, 17], [1000, 44, 1]  # a whole prompt, two over a cached prefix
    table = torch.randperm(200, device="cuda", generator=gen)[:189].view(3, 63).to(torch.int32)
    q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=dtype, generator=gen)
    start = torch.tensor([0, 1000, 1044, 1045], device="cuda")
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    ref = prefill_attention_ref(q, k, v, start, lens, table, 128**-0.5)
    out = prefill_attention_sdpa(q, k, v, tuple(q_lens), tuple(ctx), table, 128**-0.5)
    torch.testing.assert_close(out, ref, **GPU_TOL[dtype])


@pytest.mark.gpu
def test_gpu_engine_prefill_through_sdpa_gives_the_reference_tokens(monkeypatch):
    from pdserve import LLM, SamplingParams
    from pdserve.attention import TorchAttentionBackend, TritonAttentionBackend

    prompts = ["The capital of France is", "a b c d e f g h i j k l m n o p" * 8, "x"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def tokens():
        llm = LLM("tiny-llama", num_kv_blocks=256, device="cuda", dtype="float32")
        out = [o.token_ids for o in llm.generate(prompts, params)]
        llm.close()
        return out

    fast = tokens()
    monkeypatch.setattr(TritonAttentionBackend, "prefill", TorchAttentionBackend.prefill)
    assert tokens() == fast
