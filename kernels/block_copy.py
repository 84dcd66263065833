"""Block pack/unpack: gather scattered KV blocks of every layer into one contiguous staging
buffer and scatter them back — the primitive the transfer and spill paths move bytes with.

A pool is any tensor `[*planes, num_blocks, *block]` whose dim `block_dim` indexes blocks:

    GQA pool [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]   block_dim = 2
    MLA pool [num_layers, num_blocks, block_size, kv_lora_rank + rope_dim]  block_dim = 1

Shapes:
    pool:      as above, contiguous
    block_ids: [n] int, distinct, each in [0, num_blocks)
    staging:   [n, planes, block_elems], planes = prod(pool.shape[:block_dim]),
               block_elems = prod(pool.shape[block_dim + 1:]); row i holds block_ids[i]
               for all layers (and K then V), contiguous, so one block's KV is one region.

Triton kernel: one program per (block, plane, chunk of BLOCK elements); offsets in int64.
The copy is bit-exact in any dtype. Duplicate ids are refused (unpacking them would race);
an empty list packs to an empty buffer and unpacks to nothing.

block_ids may live on the host (a CPU tensor) or on the pool's device. Host ids are checked
where they are and then copied without waiting for the device; device ids must be read back
to be checked, which waits for everything queued before and leaves the device idle while
the checks and the launch run (on one H200 a 1-block pack took 65 us with device ids and
6-8 us with host ids, 256 blocks 78% -> 91% of the copy bandwidth: docs/gpu-h200.md).
Callers that build ids from a list (the spill path) pass host tensors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._launch import check_index, check_launchable

BLOCK = 1024


@triton.jit
def _block_copy_kernel(
    pool_ptr,
    staging_ptr,
    ids_ptr,
    num_blocks,
    planes,
    block_elems,
    PACK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_elems
    block = tl.load(ids_ptr + i).to(tl.int64)
    pool_at = pool_ptr + (plane * num_blocks + block) * block_elems + offs
    staging_at = staging_ptr + (i * planes + plane) * block_elems + offs
    if PACK:
        tl.store(staging_at, tl.load(pool_at, mask=mask), mask=mask)
    else:
        tl.store(pool_at, tl.load(staging_at, mask=mask), mask=mask)


def _geometry(pool: torch.Tensor, block_dim: int) -> tuple[int, int, int]:
    if not 0 <= block_dim < pool.dim():
        raise ValueError(f"block_dim {block_dim} out of range for a {pool.dim()}-d pool")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    planes = math.prod(pool.shape[:block_dim])
    return planes, pool.shape[block_dim], math.prod(pool.shape[block_dim + 1 :])


def check_block_ids(block_ids: torch.Tensor, num_blocks: int) -> None:
    check_index("block_ids", block_ids)
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-d, got shape {tuple(block_ids.shape)}")
    if block_ids.numel() == 0:
        return
    ids = block_ids.tolist()
    if min(ids) < 0 or max(ids) >= num_blocks:
        raise ValueError(f"block_ids must lie in [0, {num_blocks}), got {min(ids)}..{max(ids)}")
    if len(set(ids)) != len(ids):
        seen, dups = set(), set()
        for b in ids:
            (dups if b in seen else seen).add(b)
        raise ValueError(f"block_ids: duplicate block ids {sorted(dups)}")


def _on_device(block_ids: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """Checked ids where the kernel reads them: host ids are copied without a wait (pageable
    memory is staged by the copy call itself, so the source may be freed at once)."""
    if block_ids.device == pool.device:
        return block_ids
    if block_ids.device.type != "cpu":
        raise ValueError(f"block_ids on {block_ids.device}, pool on {pool.device}")
    return block_ids.to(pool.device, non_blocking=True)


def _launch(pool, staging, block_ids, num_blocks: int, pack: bool) -> None:
    _, planes, elems = staging.shape
    block_ids = _on_device(block_ids, pool)
    grid = (block_ids.numel(), planes, triton.cdiv(elems, BLOCK))
    _block_copy_kernel[grid](pool, staging, block_ids, num_blocks, planes, elems, pack, BLOCK)


def pack_blocks(pool: torch.Tensor, block_ids: torch.Tensor, block_dim: int) -> torch.Tensor:
    planes, num_blocks, elems = _geometry(pool, block_dim)
    check_block_ids(block_ids, num_blocks)
    staging = pool.new_empty(block_ids.numel(), planes, elems)
    if block_ids.numel():
        check_launchable(pool)
        _launch(pool, staging, block_ids, num_blocks, pack=True)
    return staging


def unpack_blocks(
    pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, block_dim: int
) -> None:
    planes, num_blocks, elems = _geometry(pool, block_dim)
    check_block_ids(block_ids, num_blocks)
    _check_staging(staging, pool, block_ids.numel(), planes, elems)
    if block_ids.numel():
        check_launchable(pool, staging)
        _launch(pool, staging.contiguous(), block_ids, num_blocks, pack=False)


def _check_staging(staging, pool, n, planes, elems) -> None:
    if staging.shape != (n, planes, elems) or staging.dtype != pool.dtype:
        raise ValueError(
            f"staging {tuple(staging.shape)} {staging.dtype} != expected "
            f"{(n, planes, elems)} {pool.dtype}"
        )


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(index in ids, first block, length) for each run of consecutive block ids."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs


def pack_blocks_ref(
    pool: torch.Tensor, block_ids: torch.Tensor, block_dim: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One strided copy per run of consecutive blocks (on CPU several times faster than a
    gather along the block dim then a transpose; a run of 64 blocks copies at ~95% of a
    contiguous copy here, single blocks at ~70%). `out`: a buffer of at least
    n * planes * block_elems elements to pack into instead of a new tensor (spills reuse
    one: fresh memory costs page faults)."""
    planes, num_blocks, elems = _geometry(pool, block_dim)
    check_block_ids(block_ids, num_blocks)
    view = pool.view(planes, num_blocks, elems)
    ids = block_ids.tolist()
    shape = (len(ids), planes, elems)
    staging = pool.new_empty(shape) if out is None else out.view(-1)[: math.prod(shape)].view(shape)
    for i, b, n in _runs(ids):
        staging[i : i + n].copy_(view[:, b : b + n].transpose(0, 1))
    return staging


def unpack_blocks_ref(
    pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, block_dim: int
) -> None:
    planes, num_blocks, elems = _geometry(pool, block_dim)
    check_block_ids(block_ids, num_blocks)
    _check_staging(staging, pool, block_ids.numel(), planes, elems)
    view = pool.view(planes, num_blocks, elems)
    for i, b, n in _runs(block_ids.tolist()):
        view[:, b : b + n].copy_(staging[i : i + n].transpose(0, 1))
