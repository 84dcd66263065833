"""Write new tokens' KV entries into their slots of a paged cache.

Shapes:
    cache:        [num_blocks, block_size, *entry]   one layer's pool (K, V or MLA latent)
    new:          [num_tokens, *entry]               same dtype as cache
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset_in_block

`entry` is `[num_kv_heads, head_dim]` for GQA K or V and `[kv_lora_rank + rope_dim]` for the
MLA latent. Slots must be distinct within one call (each token owns its slot). For the
Triton kernel a negative slot marks a padding token (a CUDA graph's spare rows) whose entry
is not written; the reference takes real slots only (its callers never pad, and it runs
in every layer of a CPU step).

Triton kernel: one program per (token, chunk of BLOCK_E entry elements); the cache's entry
dimensions must be contiguous (true for every pool view pdserve makes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_dtype, check_index, check_launchable

BLOCK_E = 256


@triton.jit
def _kv_write_kernel(cache_ptr, new_ptr, slot_ptr, entry_size, stride_new, BLOCK_E: tl.constexpr):
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK_E + tl.arange(0, BLOCK_E)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    mask = offs < tl.where(slot >= 0, entry_size, 0)  # a padding token writes nothing
    values = tl.load(new_ptr + t * stride_new + offs, mask=mask)
    tl.store(cache_ptr + slot * entry_size + offs, values.to(cache_ptr.dtype.element_ty), mask=mask)


def _check(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if new.shape[1:] != cache.shape[2:]:
        raise ValueError(f"new entries {tuple(new.shape)} do not match cache {tuple(cache.shape)}")
    if slot_mapping.shape != (new.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} != [{new.shape[0]}]")


def write_kv(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton KV write; same contract as `write_kv_ref`."""
    _check(cache, new, slot_mapping)
    check_dtype("cache", cache)
    check_dtype("new", new)
    check_index("slot_mapping", slot_mapping)
    check_launchable(cache, new, slot_mapping)
    num_tokens = new.shape[0]
    if num_tokens == 0:
        return
    entry = new[0].numel()
    try:
        flat_cache = cache.view(-1, entry)  # [num_blocks * block_size, E]
    except RuntimeError:
        raise ValueError("cache: entry dimensions must be contiguous") from None
    flat_new = new.reshape(num_tokens, entry)
    if flat_new.stride(-1) != 1:
        flat_new = flat_new.contiguous()
    grid = (num_tokens, triton.cdiv(entry, BLOCK_E))
    _kv_write_kernel[grid](flat_cache, flat_new, slot_mapping, entry, flat_new.stride(0), BLOCK_E)


def write_kv_ref(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _check(cache, new, slot_mapping)
    num_blocks, block_size = cache.shape[:2]
    # flat: [num_blocks * block_size, *entry]; a view, so the write lands in the pool.
    flat = cache.view(num_blocks * block_size, *cache.shape[2:])
    flat.index_copy_(0, slot_mapping.long(), new.to(cache.dtype))
