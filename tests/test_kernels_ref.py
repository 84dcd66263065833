"""The torch attention references against deliberately naive per-token block-table walks."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import (
    pack_blocks_ref,
    paged_gqa_decode_ref,
    paged_mla_decode_ref,
    prefill_attention_ref,
    prefill_attention_sdpa,
    unpack_blocks_ref,
    write_kv_ref,
)

# fp32 throughout; the references use SDPA, the naive walks plain loops, so sums are
# ordered differently: agreement to ~1e-6 relative.
TOL = dict(atol=2e-5, rtol=2e-5)


def random_tables(ctx_lens, block_size, num_blocks, gen):
    """Distinct random blocks per sequence, padded with junk block ids."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-c // block_size) for c in ctx_lens)
    table = torch.randint(0, num_blocks, (len(ctx_lens), width), generator=gen, dtype=torch.int32)
    for i, c in enumerate(ctx_lens):
        for j in range(-(-c // block_size)):
            table[i, j] = perm.pop()
    return table


def naive_attention(q, keys, values, scale, soft_cap=None):
    """q [Hq, D], keys [S, Hkv, D], values [S, Hkv, Dv] -> [Hq, Dv], one head at a time."""
    hq, hkv = q.shape[0], keys.shape[1]
    out = torch.empty(hq, values.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kv = h // (hq // hkv)
        scores = [float(q[h].double() @ keys[s, kv].double()) * scale for s in range(len(keys))]
        if soft_cap is not None:
            scores = [soft_cap * math.tanh(x / soft_cap) for x in scores]
        m = max(scores)
        w = [math.exp(x - m) for x in scores]
        total = sum(w)
        out[h] = sum(wi / total * values[s, kv].double() for s, wi in enumerate(w))
    return out.float()


def walk(cache, table_row, length, block_size):
    """Token by token through the block table: [length, *entry]."""
    return torch.stack(
        [cache[int(table_row[t // block_size]), t % block_size] for t in range(length)]
    )


CASES = [
    # (block_size, context lengths, num_q_heads, num_kv_heads, head_dim)
    (16, [1, 15, 16, 17, 70], 4, 4, 64),
    (16, [3, 33], 8, 2, 64),  # GQA group 4
    (64, [1, 63, 64, 65, 130], 8, 1, 128),  # group 8, head dim 128
    (16, [20, 5], 4, 1, 40),  # non-power-of-two head dim
]


@pytest.mark.parametrize("block_size,ctx,hq,hkv,dim", CASES)
@pytest.mark.parametrize("soft_cap", [None, 20.0])
def test_paged_gqa_decode_matches_naive_walk(block_size, ctx, hq, hkv, dim, soft_cap):
    gen = torch.Generator().manual_seed(hash((block_size, hq, dim)) % 1000)
    nblocks = 24
    k_cache = torch.randn(nblocks, block_size, hkv, dim, generator=gen)
    v_cache = torch.randn(nblocks, block_size, hkv, dim, generator=gen)
    table = random_tables(ctx, block_size, nblocks, gen)
    q = torch.randn(len(ctx), hq, dim, generator=gen)
    lens = torch.tensor(ctx, dtype=torch.int32)
    scale = dim**-0.5
    out = paged_gqa_decode_ref(q, k_cache, v_cache, table, lens, scale, soft_cap=soft_cap)
    for i, c in enumerate(ctx):
        keys = walk(k_cache, table[i], c, block_size)
        values = walk(v_cache, table[i], c, block_size)
        torch.testing.assert_close(
            out[i], naive_attention(q[i], keys, values, scale, soft_cap), **TOL
        )


@pytest.mark.parametrize("rank,rope", [(16, 8), (64, 16)])
def test_paged_mla_decode_matches_naive_walk(rank, rope):
    gen = torch.Generator().manual_seed(rank)
    block_size, heads, ctx = 16, 4, [1, 16, 17, 50]
    latent = torch.randn(20, block_size, rank + rope, generator=gen)
    table = random_tables(ctx, block_size, 20, gen)
    q_latent = torch.randn(len(ctx), heads, rank, generator=gen)
    q_pe = torch.randn(len(ctx), heads, rope, generator=gen)
    scale = 0.1
    out = paged_mla_decode_ref(
        q_latent, q_pe, latent, table, torch.tensor(ctx, dtype=torch.int32), scale
    )
    for i, c in enumerate(ctx):
        rows = walk(latent, table[i], c, block_size)  # [c, rank + rope]
        q = torch.cat([q_latent[i], q_pe[i]], dim=-1)
        expected = naive_attention(q, rows[:, None, :], rows[:, None, :rank], scale)
        torch.testing.assert_close(out[i], expected, **TOL)


@pytest.mark.parametrize("impl", ["ref", "sdpa"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_prefill_attention_with_cached_prefix_matches_naive(block_size, impl):
    gen = torch.Generator().manual_seed(block_size)
    hq, hkv, dim, nblocks = 4, 2, 32, 16
    ctx = [5, block_size + 3, 2 * block_size]  # total context per sequence
    q_lens = [5, 4, block_size]  # new tokens: the first has no prefix
    k_cache = torch.randn(nblocks, block_size, hkv, dim, generator=gen)
    v_cache = torch.randn(nblocks, block_size, hkv, dim, generator=gen)
    table = random_tables(ctx, block_size, nblocks, gen)
    q = torch.randn(sum(q_lens), hq, dim, generator=gen)
    start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    scale = dim**-0.5
    if impl == "ref":
        out = prefill_attention_ref(
            q, k_cache, v_cache, start, torch.tensor(ctx, dtype=torch.int32), table, scale
        )
    else:  # per sequence, host lengths, in the inputs' dtype
        out = prefill_attention_sdpa(q, k_cache, v_cache, tuple(q_lens), tuple(ctx), table, scale)
    for i, (c, n) in enumerate(zip(ctx, q_lens)):
        keys = walk(k_cache, table[i], c, block_size)
        values = walk(v_cache, table[i], c, block_size)
        for j in range(n):
            pos = c - n + j  # sees keys 0..pos
            expected = naive_attention(q[start[i] + j], keys[: pos + 1], values[: pos + 1], scale)
            torch.testing.assert_close(out[start[i] + j], expected, **TOL)


def test_prefill_attention_sdpa_matches_the_reference_for_mla_and_16_bit():
    gen = torch.Generator().manual_seed(5)
    # MLA's prefill: one shared KV "head" holding the latent (keys 40 wide, values 32)
    latent = torch.randn(12, 16, 40, generator=gen)
    k_cache, v_cache = latent.unsqueeze(2), latent[..., :32].unsqueeze(2)
    ctx, q_lens = [20, 33], [20, 7]
    table = random_tables(ctx, 16, 12, gen)
    q = torch.randn(sum(q_lens), 4, 40, generator=gen)
    start = torch.tensor([0, 20, 27])
    lens = torch.tensor(ctx, dtype=torch.int32)
    ref = prefill_attention_ref(q, k_cache, v_cache, start, lens, table, 0.2)
    out = prefill_attention_sdpa(q, k_cache, v_cache, tuple(q_lens), tuple(ctx), table, 0.2)
    torch.testing.assert_close(out, ref, **TOL)
    for dtype in (torch.bfloat16, torch.float16):
        args = (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype))
        ref = prefill_attention_ref(*args, start, lens, table, 0.2)
        out = prefill_attention_sdpa(*args, tuple(q_lens), tuple(ctx), table, 0.2)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="do not match"):
        prefill_attention_sdpa(q, k_cache, v_cache, (20,), (20,), table, 0.2)
    with pytest.raises(ValueError, match="new tokens over a context"):
        prefill_attention_sdpa(q, k_cache, v_cache, (20, 7), (20, 6), table, 0.2)


def test_write_kv_fills_exactly_the_mapped_slots():
    cache = torch.full((4, 8, 2, 3), float("nan"))
    new = torch.randn(5, 2, 3)
    slots = torch.tensor([0, 9, 31, 8, 17])
    write_kv_ref(cache, new, slots)
    flat = cache.view(32, 2, 3)
    torch.testing.assert_close(flat[slots], new, atol=0, rtol=0)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert flat[untouched].isnan().all()


def test_write_kv_rejects_mismatched_shapes():
    cache = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match="do not match"):
        write_kv_ref(cache, torch.zeros(2, 5), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_ref(cache, torch.zeros(2, 3), torch.tensor([0]))


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_pack_ref_copies_runs_and_single_blocks_exactly(layout):
    """The torch pack copies each run of consecutive ids in one go: runs, single blocks and
    runs out of order must all land in the right rows, and unpack must put them back."""
    gen = torch.Generator().manual_seed(4)
    shape, block_dim = ((3, 2, 24, 4, 2, 8), 2) if layout == "gqa" else ((3, 24, 4, 12), 1)
    pool = torch.randn(shape, generator=gen)
    ids = torch.tensor([5, 6, 7, 2, 9, 10, 0, 20, 21, 22, 23, 12])
    staging = pack_blocks_ref(pool, ids, block_dim)
    planes = math.prod(shape[:block_dim])
    expected = torch.stack([pool.select(block_dim, b).reshape(planes, -1) for b in ids.tolist()])
    assert torch.equal(staging, expected)
    out = torch.full((staging.numel() + 7,), float("nan"))  # a larger reused buffer
    assert torch.equal(pack_blocks_ref(pool, ids, block_dim, out=out), expected)
    target = torch.full_like(pool, float("nan"))
    unpack_blocks_ref(target, ids, staging, block_dim)
    assert torch.equal(target.index_select(block_dim, ids), pool.index_select(block_dim, ids))
    untouched = sorted(set(range(24)) - set(ids.tolist()))
    assert target.index_select(block_dim, torch.tensor(untouched)).isnan().all()
