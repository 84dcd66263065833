"""Paged MLA decode attention in the absorbed form over DeepSeek's latent cache.

Each cached token stores one latent row `[c_kv | k_pe]` shared by all heads (MQA-like);
the caller has already absorbed W_UK into the query (q_latent = q_nope @ W_UK) and
applies W_UV to the output.

Shapes:
    q_latent:     [B, num_heads, kv_lora_rank]
    q_pe:         [B, num_heads, rope_dim]
    latent_cache: [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_tables: [B, max_blocks] int32 block ids
    context_lens: [B] int32
    returns:      [B, num_heads, kv_lora_rank] (softmax(scale * (q_latent.c_kv + q_pe.k_pe)) @ c_kv)

Triton kernel: one program per (sequence, group of BLOCK_H heads, split). Every KV block is
read once per head group and serves all its heads (the latent is shared), MLA_TOKENS tokens
per loop step; split-KV merges through `split_reduce`. kv_lora_rank up to 512 and rope_dim
up to 64 (powers of two or masked). 16-bit inputs go to the tensor cores as they are (fp32
accumulation, p rounded to the cache dtype); fp32 inputs are multiplied in full fp32.
Limits: block_size >= 16 and a power of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import (
    check_dtype,
    check_index,
    check_launchable,
    check_tile,
    choose_num_splits,
)
from kernels._paged import check_cache
from kernels.paged_gqa_decode import paged_gqa_decode_ref
from kernels.split_reduce import split_buffers, split_reduce

BLOCK_H = 16
# tokens per loop step and warps per program (see paged_gqa_decode's GQA_TOKENS): one
# 16-token block per step in fp32 kept the H200 at 1% of its copy bandwidth. Measured on the
# H200 (`bench kernels --tiles`, docs/results/gpu/session-1/kernels.json, 2026-12-04), 64 x 8
# is within 11% of the fastest tile at both measured shapes (128 x 4: 154 vs 171 us at 64 x
# 4k tokens; 128 x 8: 38 vs 42 us at 1 x 16k) with half the tile memory of 128 tokens (a
# 128 x 576 bf16 tile fits the H200's 228 KB of shared memory, not necessarily a smaller
# GPU's). The second run also tried 1/2/4 stages and 16/32 splits: the best (32 x 4, 2
# stages) was 3% faster than the default at 64 x 4k (docs/results/gpu/kernels.json)
MLA_TOKENS = 64
MLA_WARPS = 8
# software-pipelining stages of the loop's loads (Triton's own default on CUDA: 3)
MLA_STAGES = 3


@triton.jit
def _mla_decode_kernel(
    ql_ptr,
    qpe_ptr,
    cache_ptr,
    table_ptr,
    lens_ptr,
    part_ptr,
    lse_ptr,
    scale,
    num_heads,
    blocks_per_split,
    stride_qlb,
    stride_qlh,
    stride_qpb,
    stride_qph,
    stride_cn,
    stride_ct,
    stride_tb,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    TOKENS: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    b = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    first = split * blocks_per_split * BLOCK_SIZE  # this split's tokens: [first, end)
    end = tl.minimum(first + blocks_per_split * BLOCK_SIZE, ctx)

    heads = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, TOKENS)
    h_mask = heads < num_heads
    r_mask = offs_r < RANK
    p_mask = offs_p < ROPE
    q_lat = tl.load(
        ql_ptr + b * stride_qlb + heads[:, None] * stride_qlh + offs_r[None, :],
        mask=h_mask[:, None] & r_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_R]
    q_pe = tl.load(
        qpe_ptr + b * stride_qpb + heads[:, None] * stride_qph + offs_p[None, :],
        mask=h_mask[:, None] & p_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_P]
    if not NATIVE_DOT:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(first, end, TOKENS):
        tok = start + offs_n
        t_mask = tok < end
        block_id = tl.load(table_ptr + b * stride_tb + tok // BLOCK_SIZE, mask=t_mask, other=0)
        row = (
            cache_ptr
            + block_id.to(tl.int64)[:, None] * stride_cn
            + (tok % BLOCK_SIZE)[:, None] * stride_ct
        )
        c_kv = tl.load(row + offs_r[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0.0)
        k_pe = tl.load(
            row + RANK + offs_p[None, :], mask=t_mask[:, None] & p_mask[None, :], other=0.0
        )  # [TOKENS, BLOCK_R], [TOKENS, BLOCK_P]
        if NATIVE_DOT:  # 16-bit inputs on the tensor cores, fp32 accumulation
            s = tl.dot(q_lat, tl.trans(c_kv))
            s += tl.dot(q_pe, tl.trans(k_pe))
        else:
            c_kv = c_kv.to(tl.float32)
            s = tl.dot(q_lat, tl.trans(c_kv), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(k_pe.to(tl.float32)), input_precision="ieee")
        s = tl.where(t_mask[None, :], s * scale, float("-inf"))  # [BLOCK_H, TOKENS]
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        if NATIVE_DOT:
            pv = tl.dot(p.to(c_kv.dtype), c_kv)
        else:
            pv = tl.dot(p, c_kv, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m = m_new

    safe = tl.where(denom > 0, denom, 1.0)
    tl.store(
        part_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_r[None, :],
        (acc / safe[:, None]).to(part_ptr.dtype.element_ty),
        mask=h_mask[:, None] & r_mask[None, :],
    )
    if WRITE_LSE:
        lse = tl.where(denom > 0, m + tl.log(safe), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


def paged_mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    tokens_per_step: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton MLA decode; same contract as `paged_mla_decode_ref` (`num_splits`, `out` as in
    `paged_gqa_decode`)."""
    check_cache("latent_cache", latent_cache, 3)
    for name, t in (("q_latent", q_latent), ("q_pe", q_pe), ("latent_cache", latent_cache)):
        check_dtype(name, t)
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dimension must be contiguous")
    check_index("block_tables", block_tables)
    check_index("context_lens", context_lens)
    check_launchable(q_latent, q_pe, latent_cache, block_tables, context_lens)
    batch, heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    block_size = latent_cache.shape[1]
    if q_pe.shape[:2] != (batch, heads) or latent_cache.shape[-1] != rank + rope:
        raise ValueError(
            f"latent_cache last dim {latent_cache.shape[-1]} != kv_lora_rank {rank} + "
            f"rope_dim {rope}, or q_pe {tuple(q_pe.shape)} does not match q_latent"
        )
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size}: the Triton kernel needs a power of two >= 16")
    if out is None:
        out = torch.empty_like(q_latent)
    elif out.shape != q_latent.shape or out.dtype != q_latent.dtype:
        raise ValueError(f"out: expected {tuple(q_latent.shape)} {q_latent.dtype}")
    if batch == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    max_blocks = max(1, -(-max_context_len // block_size))
    head_groups = -(-heads // BLOCK_H)
    if num_splits is None:
        num_splits = choose_num_splits(batch * head_groups, max_blocks, q_latent.device)
    num_splits = max(1, min(num_splits, max_blocks))
    tokens = check_tile(MLA_TOKENS if tokens_per_step is None else tokens_per_step)
    native = q_latent.dtype != torch.float32 and q_pe.dtype == latent_cache.dtype == q_latent.dtype
    part, lse = split_buffers(out, num_splits)
    _mla_decode_kernel[(batch, head_groups, num_splits)](
        q_latent,
        q_pe,
        latent_cache,
        block_tables,
        context_lens,
        part,
        lse,
        scale,
        heads,
        -(-max_blocks // num_splits),
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        block_tables.stride(0),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0) if num_splits > 1 else 0,
        lse.stride(1) if num_splits > 1 else 0,
        RANK=rank,
        ROPE=rope,
        BLOCK_SIZE=block_size,
        BLOCK_H=BLOCK_H,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_P=max(16, triton.next_power_of_2(rope)),
        TOKENS=tokens,
        NATIVE_DOT=native,
        WRITE_LSE=num_splits > 1,
        num_warps=MLA_WARPS if num_warps is None else num_warps,
        num_stages=MLA_STAGES if num_stages is None else num_stages,
    )
    if num_splits > 1:
        split_reduce(part, lse, out)
    return out


def latent_as_kv_head(latent_cache: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent cache as one shared KV head, without copying: keys are whole latent rows
    [N, bs, 1, rank + rope], values their first `rank` columns [N, bs, 1, rank]."""
    return latent_cache.unsqueeze(2), latent_cache[..., :rank].unsqueeze(2)


def mla_as_gqa(
    q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Absorbed MLA as GQA with one KV head: the query [B, H, r + dr] and the latent cache's
    keys and values (latent_as_kv_head), after checking the cache's width."""
    check_cache("latent_cache", latent_cache, 3)
    rank = q_latent.shape[-1]
    if latent_cache.shape[-1] != rank + q_pe.shape[-1]:
        raise ValueError(
            f"latent_cache last dim {latent_cache.shape[-1]} != kv_lora_rank {rank} + "
            f"rope_dim {q_pe.shape[-1]}"
        )
    k_cache, v_cache = latent_as_kv_head(latent_cache, rank)
    return torch.cat([q_latent, q_pe], dim=-1), k_cache, v_cache


def paged_mla_decode_ref(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:
    q, k_cache, v_cache = mla_as_gqa(q_latent, q_pe, latent_cache)
    return paged_gqa_decode_ref(
        q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len=max_context_len
    )
