"""Shared helpers of the torch references: gathering a sequence's paged KV."""

from __future__ import annotations

import torch


def gather_paged(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """cache [N, block_size, *entry], block_tables [B, >= num_blocks] -> [B, S, *entry].

    S = num_blocks * block_size; entries past a sequence's length are whatever the table's
    padding points at and must be masked by the caller.
    """
    if block_tables.shape[1] < num_blocks:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns; the context needs {num_blocks}"
        )
    table = block_tables[:, :num_blocks].long()  # [B, nb]
    batch, block_size = table.shape[0], cache.shape[1]
    # index_select of whole blocks as rows of a 2-D view: on CPU ~5x faster than over the
    # 4-D pool (25 MB of blocks: 1.8 ms vs 9.2 ms on 2 cores) and than advanced indexing
    rows = cache.view(cache.shape[0], -1) if cache.is_contiguous() else cache
    gathered = rows.index_select(0, table.flatten())  # [B * nb, block_size * entry]
    return gathered.view(batch, num_blocks * block_size, *cache.shape[2:])


def check_cache(name: str, cache: torch.Tensor, ndim: int) -> None:
    if cache.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(cache.shape)}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Attention arithmetic runs in fp32 whatever the storage dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
