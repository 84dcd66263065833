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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._paged import check_cache, compute_dtype, gather_paged


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
