"""The C decode kernels and the oneDNN-packed Linear: the CPU fast paths against the naive
walks and nn.Linear. On a machine without a C compiler the kernel cannot build; there the
test says so, and the engine's `auto` backend must have fallen back to torch."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from kernels import paged_decode_cpu
from kernels.cpu_native import NativeUnavailable, load
from pdserve.attention import ATTENTION_BACKENDS, CpuAttentionBackend, TorchAttentionBackend
from pdserve.models.layers import ONEDNN_LINEAR, Linear
from tests.test_kernels_ref import CASES, TOL, naive_attention, random_tables, walk

needs_kernel = pytest.mark.skipif(
    not paged_decode_cpu.available(), reason="the C decode kernel does not build here"
)


def test_the_kernel_builds_where_there_is_a_compiler():
    if shutil.which("cc") or shutil.which("gcc"):
        assert paged_decode_cpu.available()
        assert isinstance(ATTENTION_BACKENDS["auto"](torch.device("cpu")), CpuAttentionBackend)
    else:
        with pytest.raises(NativeUnavailable):
            load("paged_decode_cpu")
        assert type(ATTENTION_BACKENDS["auto"](torch.device("cpu"))) is TorchAttentionBackend


@needs_kernel
@pytest.mark.parametrize(
    "block_size,ctx,hq,hkv,dim",
    CASES
    + [
        (32, [1, 31, 32, 100], 9, 3, 64),
        # group 6 (tiles of 4 + 2 heads, score passes of 3 + 1 and 2), head dim 72 (whole
        # 8-lane vectors, not whole 16-column value chunks), rows 7-9 about a chunk of 8
        (16, [7, 8, 9, 41], 12, 2, 72),
    ],
)
def test_paged_gqa_decode_cpu_matches_naive_walk(block_size, ctx, hq, hkv, dim):
    gen = torch.Generator().manual_seed(hash((block_size, hq, dim, 7)) % 1000)
    nblocks = 24
    k_cache = torch.randn(nblocks, block_size, hkv, dim, generator=gen)
    v_cache = torch.randn(nblocks, block_size, hkv, dim, generator=gen)
    table = random_tables(ctx, block_size, nblocks, gen)
    q = torch.randn(len(ctx), hq, dim, generator=gen)
    lens = torch.tensor(ctx, dtype=torch.int32)
    out = paged_decode_cpu.paged_gqa_decode_cpu(q, k_cache, v_cache, table, lens, dim**-0.5)
    for i, c in enumerate(ctx):
        keys = walk(k_cache, table[i], c, block_size)
        values = walk(v_cache, table[i], c, block_size)
        torch.testing.assert_close(out[i], naive_attention(q[i], keys, values, dim**-0.5), **TOL)


@needs_kernel
def test_paged_gqa_decode_cpu_far_apart_scores():
    """Scores hundreds apart (weights of e^-87 and below) and a running max that moves up
    late in the context: the softmax's clamp and its rescale of what was summed before."""
    gen = torch.Generator().manual_seed(5)
    block_size, hq, hkv, dim, ctx = 16, 6, 2, 64, [200, 37]
    k_cache = torch.randn(30, block_size, hkv, dim, generator=gen)
    v_cache = torch.randn(30, block_size, hkv, dim, generator=gen)
    table = random_tables(ctx, block_size, 30, gen)
    q = torch.randn(len(ctx), hq, dim, generator=gen) * 4
    for i, c in enumerate(ctx):  # each sequence's last key: the best match, by far
        last = table[i, (c - 1) // block_size]
        k_cache[last, (c - 1) % block_size] = q[i].view(hkv, -1, dim)[:, 0] * 3
    lens = torch.tensor(ctx, dtype=torch.int32)
    out = paged_decode_cpu.paged_gqa_decode_cpu(q, k_cache, v_cache, table, lens, 1.0)
    for i, c in enumerate(ctx):
        keys = walk(k_cache, table[i], c, block_size)
        values = walk(v_cache, table[i], c, block_size)
        torch.testing.assert_close(out[i], naive_attention(q[i], keys, values, 1.0), **TOL)


@needs_kernel
@pytest.mark.parametrize("batch", [1, 3, 8, 20])  # one KV head per task, then whole sequences
def test_every_task_split_gives_the_same_rows(batch):
    gen = torch.Generator().manual_seed(batch)
    block_size, hq, hkv, dim = 16, 8, 4, 64
    k_cache = torch.randn(64, block_size, hkv, dim, generator=gen)
    v_cache = torch.randn(64, block_size, hkv, dim, generator=gen)
    ctx = [int(x) for x in torch.randint(1, 40, (batch,), generator=gen)]
    table = random_tables(ctx, block_size, 64, gen)
    q = torch.randn(batch, hq, dim, generator=gen)
    lens = torch.tensor(ctx, dtype=torch.int32)
    out = paged_decode_cpu.paged_gqa_decode_cpu(q, k_cache, v_cache, table, lens, 0.125)
    ref = paged_decode_cpu_ref(q, k_cache, v_cache, table, lens)
    torch.testing.assert_close(out, ref, **TOL)
    # each row is computed alone, in a fixed order: batch-invariant bit for bit
    alone = paged_decode_cpu.paged_gqa_decode_cpu(
        q[-1:], k_cache, v_cache, table[-1:], lens[-1:], 0.125
    )
    assert torch.equal(alone[0], out[-1])


def paged_decode_cpu_ref(q, k_cache, v_cache, table, lens):
    from kernels import paged_gqa_decode_ref

    return paged_gqa_decode_ref(q, k_cache, v_cache, table, lens, 0.125)


@needs_kernel
@pytest.mark.parametrize("rank,rope", [(16, 8), (512, 64)])  # 512 + 64: DeepSeek's sizes
def test_paged_mla_decode_cpu_matches_naive_walk(rank, rope):
    gen = torch.Generator().manual_seed(rank)
    block_size, heads, ctx = 16, 4, [1, 16, 17, 50]
    latent = torch.randn(20, block_size, rank + rope, generator=gen)
    table = random_tables(ctx, block_size, 20, gen)
    q_latent = torch.randn(len(ctx), heads, rank, generator=gen)
    q_pe = torch.randn(len(ctx), heads, rope, generator=gen)
    lens = torch.tensor(ctx, dtype=torch.int32)
    out = paged_decode_cpu.paged_mla_decode_cpu(q_latent, q_pe, latent, table, lens, 0.05)
    for i, c in enumerate(ctx):
        rows = walk(latent, table[i], c, block_size)
        q = torch.cat([q_latent[i], q_pe[i]], dim=-1)
        expected = naive_attention(q, rows[:, None, :], rows[:, None, :rank], 0.05)
        torch.testing.assert_close(out[i], expected, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_bad_inputs_are_refused_with_the_reason():
    k = torch.randn(4, 16, 2, 8)
    q = torch.randn(1, 4, 8)
    table = torch.tensor([[0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs more"):
        paged_decode_cpu.paged_gqa_decode_cpu(q, k, k, table, torch.tensor([17]), 1.0)
    with pytest.raises(ValueError, match="fp32"):
        paged_decode_cpu.paged_gqa_decode_cpu(
            q.half(), k.half(), k.half(), table, torch.tensor([3]), 1.0
        )
    with pytest.raises(ValueError, match="do not match"):
        paged_decode_cpu.paged_gqa_decode_cpu(
            torch.randn(1, 3, 8), k, k, table, torch.tensor([3]), 1.0
        )


def test_packed_linear_matches_nn_linear_and_follows_weight_changes(monkeypatch):
    monkeypatch.setattr(Linear, "native_rows", 0)  # few rows too: not the small-GEMM kernel
    monkeypatch.setattr(Linear, "cpu_gemm", "onednn")  # oneDNN's copy, not panels
    torch.manual_seed(0)
    layer = Linear(48, 40, bias=True).requires_grad_(False)  # no gradients: the fast paths
    packed = layer.pack_for_cpu()
    assert packed == ONEDNN_LINEAR and (layer.packed is not None) == ONEDNN_LINEAR
    for rows in (1, 3, 8, 70):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), **TOL)
    with torch.no_grad():
        layer.weight.mul_(2)  # changed in place after packing: the packed copy is not used
    x = torch.randn(5, 48)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), **TOL)
    assert layer.packed is None
    assert not Linear(8, 8).to(torch.bfloat16).pack_for_cpu()  # fp32 only


@needs_kernel
def test_loading_the_kernel_leaves_the_floating_point_mode_alone():
    # a library linked with -ffast-math would set flush-to-zero for the whole process
    load("paged_decode_cpu")
    tiny = float("5e-324")  # the smallest subnormal double
    assert tiny * 1.0 > 0.0
    assert torch.tensor(1e-40, dtype=torch.float32).mul(1.0).item() > 0.0


@needs_kernel
@pytest.mark.parametrize("row_max_context", [512, 0])
def test_cpu_prefill_matches_torch_as_decode_rows_and_as_sdpa(monkeypatch, row_max_context):
    """Short contexts go through the decode kernel a token a row, longer ones (here: all,
    with the bound at 0) through SDPA per sequence; the greedy tokens are the torch
    backend's either way."""
    from pdserve import LLM, SamplingParams, attention

    seqs, rows = [], []  # the chunks that went to SDPA per sequence / to the decode kernel
    real_sdpa, real_rows = attention.prefill_attention_sdpa, attention.prefill_rows

    def counted_sdpa(*args):
        seqs.append(len(args[3]))
        return real_sdpa(*args)

    def counted_rows(*args):
        rows.append(sum(args[0]))
        return real_rows(*args)

    monkeypatch.setattr(attention, "prefill_attention_sdpa", counted_sdpa)
    monkeypatch.setattr(attention, "prefill_rows", counted_rows)
    monkeypatch.setattr(attention, "CPU_ROW_PREFILL_MAX_CONTEXT", row_max_context)
    # prompts of different lengths, one sharing another's prefix (a chunk over cached blocks)
    prompts = [[1 + i, 5, 9, 11] * (i + 2) for i in range(5)] + [[1, 5, 9, 11] * 8 + [3, 4]]
    params = SamplingParams(max_tokens=6, temperature=0)
    outs = {}
    for backend in ("cpu", "torch"):
        llm = LLM("tiny-llama", attention_backend=backend, block_size=4)
        try:
            outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.close()
        if backend == "cpu" and row_max_context:
            assert rows and not seqs
        elif backend == "cpu":
            assert seqs and max(seqs) <= attention.CPU_SDPA_PREFILL_MAX_SEQS and not rows
        seqs.clear()
        rows.clear()
    assert outs["cpu"] == outs["torch"]


@needs_kernel
@pytest.mark.parametrize("mla", [False, True])
def test_prefill_as_decode_rows_matches_the_reference(mla):
    """prefill_rows + the decode kernel against prefill_attention_ref: whole prompts and
    chunks over a cached prefix, blocks scattered over the pool, GQA and MLA's one latent
    head (its values the first columns of its keys, as the backend passes them)."""
    from kernels import latent_as_kv_head, prefill_attention_ref, prefill_rows

    gen = torch.Generator().manual_seed(7 + mla)
    block_size, nblocks = 4, 64
    ctx, q_lens = [3, 9, 17, 30], [3, 2, 17, 11]
    if mla:
        latent = torch.randn(nblocks, block_size, 40, generator=gen)
        k_cache, v_cache = latent_as_kv_head(latent, 32)
        hq, dim = 4, 40
    else:
        hq, dim = 6, 16
        k_cache = torch.randn(nblocks, block_size, 2, dim, generator=gen)
        v_cache = torch.randn(nblocks, block_size, 2, dim, generator=gen)
    perm = torch.randperm(nblocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(ctx), 8, dtype=torch.int32)
    used = 0
    for i, c in enumerate(ctx):
        n = -(-c // block_size)
        table[i, :n] = perm[used : used + n]
        used += n
    q = torch.randn(sum(q_lens), hq, dim, generator=gen)
    start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    want = prefill_attention_ref(
        q, k_cache, v_cache, start, torch.tensor(ctx, dtype=torch.int32), table, 0.3
    )
    tables, contexts = prefill_rows(tuple(q_lens), tuple(ctx), table)
    assert contexts.tolist() == [1, 2, 3, 8, 9, *range(1, 18), *range(20, 31)]
    got = paged_decode_cpu.paged_gqa_decode_cpu(q, k_cache, v_cache, tables, contexts, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="new tokens over a context"):
        prefill_rows((4,), (3,), table)


@needs_kernel
def test_a_chunk_of_short_and_long_prefills_matches_the_reference_sequence_by_sequence(
    monkeypatch,
):
    """Short sequences as decode rows, long ones through SDPA, in one chunk: the output
    matches the reference, and each sequence's rows are bit for bit what it gets alone
    (what a prompt computes does not depend on what shares its chunk)."""
    from kernels import prefill_attention_ref
    from pdserve import attention
    from pdserve.attention import AttentionMetadata, CpuAttentionBackend

    monkeypatch.setattr(attention, "CPU_ROW_PREFILL_MAX_CONTEXT", 12)
    gen = torch.Generator().manual_seed(3)
    bs, nblocks, hq, dim = 4, 64, 6, 16
    k_cache = torch.randn(nblocks, bs, 2, dim, generator=gen)
    v_cache = torch.randn(nblocks, bs, 2, dim, generator=gen)
    perm = torch.randperm(nblocks, generator=gen).to(torch.int32)
    seqs = [(5, 5), (9, 20), (3, 12), (13, 13), (2, 7)]  # (new tokens, context)

    def meta_of(chosen):
        table = torch.zeros(len(chosen), 8, dtype=torch.int32)
        for row, i in enumerate(chosen):
            table[row, : -(-seqs[i][1] // bs)] = perm[8 * i : 8 * i + -(-seqs[i][1] // bs)]
        lens, ctx = tuple(seqs[i][0] for i in chosen), tuple(seqs[i][1] for i in chosen)
        start = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.int64),
            num_decode=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
            decode_context_lens=torch.zeros(0, dtype=torch.int32),
            decode_max_context=0,
            num_prefill_tokens=sum(lens),
            prefill_query_start_loc=start,
            prefill_context_lens=torch.tensor(ctx, dtype=torch.int32),
            prefill_block_tables=table,
            prefill_max_query=max(lens),
            prefill_max_context=max(ctx),
            prefill_query_lens_host=lens,
            prefill_context_lens_host=ctx,
        )
        return meta, start

    q_all = torch.randn(sum(n for n, _ in seqs), hq, dim, generator=gen)
    offsets = [0, *torch.tensor([n for n, _ in seqs]).cumsum(0).tolist()]
    meta, start = meta_of(range(len(seqs)))
    backend = CpuAttentionBackend()
    got = backend.gqa(q_all, k_cache, v_cache, meta, 0.25)
    want = prefill_attention_ref(
        q_all, k_cache, v_cache, start, meta.prefill_context_lens, meta.prefill_block_tables, 0.25
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for i in range(len(seqs)):  # alone
        alone_meta, _ = meta_of([i])
        a, b = offsets[i], offsets[i + 1]
        alone = backend.gqa(q_all[a:b].clone(), k_cache, v_cache, alone_meta, 0.25)
        assert torch.equal(alone, got[a:b]), i
