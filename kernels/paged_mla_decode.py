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
"""

from __future__ import annotations

import torch

from kernels._paged import check_cache
from kernels.paged_gqa_decode import paged_gqa_decode_ref


def paged_mla_decode_ref(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:
    check_cache("latent_cache", latent_cache, 3)
    rank = q_latent.shape[-1]
    if latent_cache.shape[-1] != rank + q_pe.shape[-1]:
        raise ValueError(
            f"latent_cache last dim {latent_cache.shape[-1]} != kv_lora_rank {rank} + "
            f"rope_dim {q_pe.shape[-1]}"
        )
    # As one KV head: keys are the whole latent row, values its first kv_lora_rank columns.
    q = torch.cat([q_latent, q_pe], dim=-1)
    k_cache = latent_cache.unsqueeze(2)  # [N, bs, 1, rank + rope]
    v_cache = latent_cache[..., :rank].unsqueeze(2)  # [N, bs, 1, rank] (a view)
    return paged_gqa_decode_ref(
        q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len=max_context_len
    )
