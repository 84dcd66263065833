"""Write new tokens' KV entries into their slots of a paged cache.

Shapes:
    cache:        [num_blocks, block_size, *entry]   one layer's pool (K, V or MLA latent)
    new:          [num_tokens, *entry]               same dtype as cache
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset_in_block

`entry` is `[num_kv_heads, head_dim]` for GQA K or V and `[kv_lora_rank + rope_dim]` for the
MLA latent. Slots must be distinct within one call (each token owns its slot).
"""

from __future__ import annotations

import torch


def write_kv_ref(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_blocks, block_size = cache.shape[:2]
    if new.shape[1:] != cache.shape[2:]:
        raise ValueError(f"new entries {tuple(new.shape)} do not match cache {tuple(cache.shape)}")
    if slot_mapping.shape != (new.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} != [{new.shape[0]}]")
    # flat: [num_blocks * block_size, *entry]; a view, so the write lands in the pool.
    flat = cache.view(num_blocks * block_size, *cache.shape[2:])
    flat.index_copy_(0, slot_mapping, new.to(cache.dtype))
