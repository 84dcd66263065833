"""Causal prefill attention over variable-length sequences that may continue a cached prefix.

Sequence i contributes `q_len_i` new query tokens (packed back to back in `q`) and attends
to `context_len_i` tokens of KV, all read from the paged cache: the cached prefix plus the
new tokens themselves, which the caller wrote into their slots first. New token j of
sequence i sits at position `context_len_i - q_len_i + j` and sees keys at positions <= its own.

Shapes:
    q:               [T, num_q_heads, head_dim], T = sum(q_len_i)
    k_cache:         [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache:         [num_blocks, block_size, num_kv_heads, head_dim_v]
    query_start_loc: [B + 1] int64, cumulative q_len (query_start_loc[0] == 0)
    context_lens:    [B] int32, context_len_i >= q_len_i
    block_tables:    [B, max_blocks] int32
    returns:         [T, num_q_heads, head_dim_v]

Sequences are padded to the longest query and context in the batch and handled in one
batched call (no per-sequence Python loop).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._paged import check_cache, compute_dtype, gather_paged


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    check_cache("k_cache", k_cache, 4)
    check_cache("v_cache", v_cache, 4)
    device = q.device
    batch = context_lens.shape[0]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [B]
    if max_query_len is None:
        max_query_len = int(query_lens.max())
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    block_size = k_cache.shape[1]
    num_blocks = -(-max_context_len // block_size)
    dtype = compute_dtype(q.dtype)

    # Scatter the packed queries into [B, Qmax]: token t of sequence i goes to row i, col j.
    j = torch.arange(max_query_len, device=device)
    in_query = j[None, :] < query_lens[:, None]  # [B, Qmax]
    packed_index = (query_start_loc[:-1, None] + j[None, :])[in_query]  # [T] in packed order
    q_pad = q.new_zeros(batch, max_query_len, *q.shape[1:], dtype=dtype)
    q_pad[in_query] = q[packed_index].to(dtype)

    k = gather_paged(k_cache, block_tables, num_blocks).to(dtype)  # [B, S, Hkv, D]
    v = gather_paged(v_cache, block_tables, num_blocks).to(dtype)  # [B, S, Hkv, Dv]
    q_pos = (context_lens - query_lens)[:, None] + j[None, :]  # [B, Qmax]
    k_pos = torch.arange(k.shape[1], device=device)
    # key visible iff at or before the query's position (and so inside the context)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Qmax, S]
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),  # [B, Hq, Qmax, D]
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )  # [B, Hq, Qmax, Dv]
    out = out.transpose(1, 2)[in_query]  # [T, Hq, Dv] in packed order
    return out.to(q.dtype)
