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

`prefill_attention_ref`: sequences padded to the longest query and context in the batch and
handled in one batched call (no per-sequence Python loop), in fp32 with a boolean mask.

`prefill_attention_sdpa`: one SDPA call per sequence over its own context (no padding), in
the inputs' dtype, with the query and context lengths given as host ints (nothing is read
back from the device). A whole prompt (no cached prefix) is plain causal attention, which
PyTorch runs as FlashAttention on a GPU; a chunk over a cached prefix passes its mask. On
one H200 the reference's fp32 path took 25.6 of the 57 ms of device time of a 1,024-token
prefill of a Llama-3-8B-shaped model, and its boolean indexing read back from the device
in every layer (scripts/profile_steps.py, docs/gpu-h200.md).

`prefill_rows`: the same chunk as one decode query per new token (its block table row and
its own context), for a decode kernel to compute in one call: the CPU backend's path for
short contexts (pdserve/attention.py).
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


def prefill_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as `prefill_attention_ref`, with the lengths as host ints."""
    check_cache("k_cache", k_cache, 4)
    check_cache("v_cache", v_cache, 4)
    if len(query_lens) != len(context_lens) or sum(query_lens) != q.shape[0]:
        raise ValueError(
            f"query_lens {query_lens} / context_lens {context_lens} do not match q's "
            f"{q.shape[0]} tokens"
        )
    _check_lengths(query_lens, context_lens)
    block_size = k_cache.shape[1]
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    start = 0
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        blocks = -(-ctx // block_size)
        table = block_tables[i : i + 1]
        k = gather_paged(k_cache, table, blocks)[0, :ctx].transpose(0, 1)  # [Hkv, ctx, D]
        v = gather_paged(v_cache, table, blocks)[0, :ctx].transpose(0, 1)
        qi = q[start : start + n].transpose(0, 1)  # [Hq, n, D]
        mask = None
        if n < ctx:  # over a cached prefix: new token j sits at ctx - n + j
            q_pos = torch.arange(ctx - n, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [n, ctx]
        o = F.scaled_dot_product_attention(
            qi[None],
            k[None],
            v[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )  # [1, Hq, n, Dv]
        out[start : start + n] = o[0].transpose(0, 1)
        start += n
    return out


def prefill_rows(
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk as decode queries, one per new token: the last n of a sequence's ctx
    tokens are new, and its j-th new token attends to the first ctx - n + j + 1 (causal
    over its cached prefix and the chunk) -> (each token's block table row
    [T, max_blocks] int32, its context [T] int32), T = sum(query_lens). Any decode kernel
    then computes the chunk's attention in one call."""
    if len(query_lens) != len(context_lens) or len(query_lens) > block_tables.shape[0]:
        raise ValueError(
            f"query_lens {query_lens} / context_lens {context_lens} / "
            f"{block_tables.shape[0]} block tables do not match"
        )
    _check_lengths(query_lens, context_lens)
    lens = torch.tensor(query_lens, dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(query_lens)), lens)
    first = torch.tensor([c - n + 1 for n, c in zip(query_lens, context_lens)], dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens  # each sequence's first row
    contexts = first[seq] + torch.arange(int(lens.sum())) - starts[seq]
    tables = block_tables.index_select(0, seq.to(block_tables.device)).to(torch.int32)
    return tables, contexts.to(torch.int32).to(block_tables.device)


def _check_lengths(query_lens: tuple[int, ...], context_lens: tuple[int, ...]) -> None:
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        if not 0 < n <= ctx:
            raise ValueError(f"sequence {i}: {n} new tokens over a context of {ctx}")
