"""Paged GQA/MHA decode attention: one query token per sequence over a paged KV cache.

Shapes:
    q:            [B, num_q_heads, head_dim]
    k_cache:      [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache:      [num_blocks, block_size, num_kv_heads, head_dim_v]
    block_tables: [B, max_blocks] int32, block ids (offsets into the pool, never pointers);
                  entries past a sequence's last block are padding and never read unmasked
    context_lens: [B] int32, tokens of KV each sequence attends to (its new token included)
    returns:      [B, num_q_heads, head_dim_v] in q's dtype

Query head h reads KV head h // (num_q_heads // num_kv_heads). Scores are
`scale * q.k`, optionally soft-capped as `cap * tanh(score / cap)`; softmax in fp32.

Triton kernel: one program per (sequence, KV head, split); the query heads of a group are
processed together (one KV read serves the whole group). A split walks its range of tokens
GQA_TOKENS at a time (each token's KV block looked up in the table) with an online softmax;
with more than one split the partial results are merged by `split_reduce` (flash-decoding),
so small batches with long contexts still fill the GPU. 16-bit inputs go to the tensor cores
as they are (q.k and p.v accumulate in fp32; p is rounded to the value dtype, as
FlashAttention does); fp32 inputs are multiplied in full fp32 ("ieee", not TF32). Softmax
statistics are fp32. Head dims need not be powers of two (masked). Limits: block_size >= 16
and a power of two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._launch import (
    check_dtype,
    check_index,
    check_launchable,
    check_tile,
    choose_num_splits,
)
from kernels._paged import check_cache, compute_dtype, gather_paged
from kernels.split_reduce import split_buffers, split_reduce

# The tile: tokens of KV per loop step (across as many KV blocks as they span) and warps per
# program. One 16-token block per step in fp32 (the first kernel) kept the H200 at 8% of its
# copy bandwidth: each step waited on one small load. 64 x 4 was the fastest measured tile at
# 64 x 4k tokens (254 us, 4.2 TB/s) and within 1% of it at 1 x 16k (`bench kernels --tiles`,
# docs/results/gpu/session-1/kernels.json, H200, 2026-12-04); the fastest at both in the
# second run (258.6 and 47.7 us, docs/results/gpu/kernels.json).
GQA_TOKENS = 64
GQA_WARPS = 4
# software-pipelining stages of the loop's loads (Triton's own default on CUDA: 3)
GQA_STAGES = 3


@triton.jit
def _gqa_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    part_ptr,
    lse_ptr,
    scale,
    soft_cap,
    blocks_per_split,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kt,
    stride_kh,
    stride_vn,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    TOKENS: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    first = split * blocks_per_split * BLOCK_SIZE  # this split's tokens: [first, end)
    end = tl.minimum(first + blocks_per_split * BLOCK_SIZE, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, TOKENS)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < HEAD_DIM_V
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if not NATIVE_DOT:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for start in range(first, end, TOKENS):
        # TOKENS tokens at a time, across as many KV blocks as they span
        tok = start + offs_n
        t_mask = tok < end
        block_id = tl.load(table_ptr + b * stride_tb + tok // BLOCK_SIZE, mask=t_mask, other=0)
        row = block_id.to(tl.int64)[:, None] * stride_kn + (tok % BLOCK_SIZE)[:, None] * stride_kt
        k = tl.load(
            k_ptr + row + kv_head * stride_kh + offs_d[None, :],
            mask=t_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [TOKENS, BLOCK_D]
        if NATIVE_DOT:  # 16-bit inputs on the tensor cores, fp32 accumulation
            s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_G, TOKENS]
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        if SOFT_CAP:
            s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0)  # cap * tanh(s / cap)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        vrow = block_id.to(tl.int64)[:, None] * stride_vn + (tok % BLOCK_SIZE)[:, None] * stride_vt
        v = tl.load(
            v_ptr + vrow + kv_head * stride_vh + offs_dv[None, :],
            mask=t_mask[:, None] & dv_mask[None, :],
            other=0.0,
        )  # [TOKENS, BLOCK_DV]
        denom = denom * alpha + tl.sum(p, axis=1)
        if NATIVE_DOT:
            pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m = m_new

    safe = tl.where(denom > 0, denom, 1.0)
    out = acc / safe[:, None]
    tl.store(
        part_ptr
        + b * stride_pb
        + heads[:, None] * stride_ph
        + split * stride_ps
        + offs_dv[None, :],
        out.to(part_ptr.dtype.element_ty),
        mask=g_mask[:, None] & dv_mask[None, :],
    )
    if WRITE_LSE:
        lse = tl.where(denom > 0, m + tl.log(safe), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


def paged_gqa_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    soft_cap: float | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    tokens_per_step: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton paged decode; same contract as `paged_gqa_decode_ref`.

    `num_splits` overrides the split-KV choice; `out` ([B, num_q_heads, head_dim_v], q's
    dtype) receives the result when given. `tokens_per_step` (a power of two >= 16),
    `num_warps` and `num_stages` override the tile (GQA_TOKENS, GQA_WARPS, GQA_STAGES;
    `bench kernels --tiles` measures the choices).
    """
    check_cache("k_cache", k_cache, 4)
    check_cache("v_cache", v_cache, 4)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, t)
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dimension must be contiguous")
    check_index("block_tables", block_tables)
    check_index("context_lens", context_lens)
    check_launchable(q, k_cache, v_cache, block_tables, context_lens)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_dim = k_cache.shape
    head_dim_v = v_cache.shape[-1]
    if kv_dim != head_dim or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            f"cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} vs q {tuple(q.shape)}"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of {num_kv_heads}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size}: the Triton kernel needs a power of two >= 16")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError("block_tables / context_lens do not match the batch")
    if out is None:
        out = torch.empty(batch, num_q_heads, head_dim_v, dtype=q.dtype, device=q.device)
    elif out.shape != (batch, num_q_heads, head_dim_v) or out.dtype != q.dtype:
        raise ValueError(f"out: expected {(batch, num_q_heads, head_dim_v)} {q.dtype}")
    if batch == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    max_blocks = max(1, -(-max_context_len // block_size))
    if num_splits is None:
        num_splits = choose_num_splits(batch * num_kv_heads, max_blocks, q.device)
    num_splits = max(1, min(num_splits, max_blocks))
    blocks_per_split = -(-max_blocks // num_splits)
    group = num_q_heads // num_kv_heads
    tokens = check_tile(GQA_TOKENS if tokens_per_step is None else tokens_per_step)
    native = q.dtype != torch.float32 and k_cache.dtype == v_cache.dtype == q.dtype
    part, lse = split_buffers(out, num_splits)
    _gqa_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        part,
        lse,
        scale,
        soft_cap or 1.0,
        blocks_per_split,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0) if num_splits > 1 else 0,
        lse.stride(1) if num_splits > 1 else 0,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)),
        TOKENS=tokens,
        NATIVE_DOT=native,
        SOFT_CAP=soft_cap is not None,
        WRITE_LSE=num_splits > 1,
        num_warps=GQA_WARPS if num_warps is None else num_warps,
        num_stages=GQA_STAGES if num_stages is None else num_stages,
    )
    if num_splits > 1:
        split_reduce(part, lse, out)
    return out


def paged_gqa_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    soft_cap: float | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    check_cache("k_cache", k_cache, 4)
    check_cache("v_cache", v_cache, 4)
    batch, num_q_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of {num_kv_heads}")
    block_size = k_cache.shape[1]
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if batch else 0
    num_blocks = -(-max_context_len // block_size)
    dtype = compute_dtype(q.dtype)
    k = gather_paged(k_cache, block_tables, num_blocks).to(dtype)  # [B, S, Hkv, D]
    v = gather_paged(v_cache, block_tables, num_blocks).to(dtype)  # [B, S, Hkv, Dv]
    positions = torch.arange(k.shape[1], device=q.device)
    valid = positions[None, :] < context_lens[:, None]  # [B, S]
    qh = q.to(dtype).unsqueeze(2)  # [B, Hq, 1, D]
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, S, D]
    if soft_cap is None:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
        )
    else:
        group = num_q_heads // num_kv_heads
        kh = kh.repeat_interleave(group, dim=1)
        vh = vh.repeat_interleave(group, dim=1)
        scores = (qh @ kh.transpose(-1, -2)) * scale  # [B, Hq, 1, S]
        scores = soft_cap * torch.tanh(scores / soft_cap)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        out = scores.softmax(dim=-1) @ vh
    return out.squeeze(2).to(q.dtype)
