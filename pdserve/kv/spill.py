"""Moving a preempted request's KV between the device pool and the spill tiers.

    spill(key, block_ids)   hand the tiered store a BlockSource: the tier that takes the
                            entry has the blocks (every layer, K and V) packed straight into
                            its own memory (host/CXL slots, the disk writer's buffer), one
                            copy; -> the tier's name, or None when no tier could take it
                            (the caller recomputes instead)
    reload(key, block_ids)  the tier hands the blocks back piece by piece (disk: each piece
                            read and verified) and each piece is unpacked straight into the
                            freshly allocated blocks; False when the bytes are lost or fail
                            their checksum (the caller recomputes; wrong KV is never used)
    copy_back(key, ids)     the same without dropping the entry (offloaded prefixes, see
                            pdserve/kv/prefix_offload.py)

Packing uses kernels/block_copy.py: the Triton kernels on CUDA (then one copy into the
tier's host memory), the torch path on CPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from kernels.block_copy import pack_blocks, pack_blocks_ref, unpack_blocks, unpack_blocks_ref
from pdserve.kv.kv_cache import KVCache
from transfer.tiers import BlockSource, ReloadFailed, SpillFailed, TieredStore

log = logging.getLogger(__name__)


class KVSpiller:
    def __init__(self, kv_cache: KVCache, store: TieredStore) -> None:
        self.kv = kv_cache
        self.store = store
        pool = kv_cache.pool
        self._cuda = pool.device.type == "cuda"
        self._unpack = unpack_blocks if self._cuda else unpack_blocks_ref
        # a staging row: one block of every plane (layer x K/V), see kernels/block_copy.py
        dim = kv_cache.block_dim
        self._row_shape = (math.prod(pool.shape[:dim]), math.prod(pool.shape[dim + 1 :]))
        self._blocks: dict[str, int] = {}  # key -> blocks spilled under it
        # called when no tier has room for a spill: frees some (True) or cannot (False);
        # set by pdserve.kv.prefix_offload to drop cached prefixes first
        self.make_room: Callable[[], bool] | None = None
        self.failed_spills = 0
        self.made_room = 0  # cached prefixes dropped so that a request's spill fits
        self.failed_reloads = 0

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int32, device=self.kv.pool.device)

    def _fill(self, ids: torch.Tensor):
        pool, dim = self.kv.pool, self.kv.block_dim

        def fill(out: torch.Tensor, start: int, stop: int) -> None:
            if self._cuda:
                out.copy_(pack_blocks(pool, ids[start:stop], dim))
            else:
                pack_blocks_ref(pool, ids[start:stop], dim, out=out)

        return fill

    def store_blocks(self, key: str, block_ids: list[int]) -> str:
        """Pack the blocks into the first tier with room; -> its name. SpillFailed if none."""
        source = BlockSource(
            len(block_ids), self._row_shape, self.kv.pool.dtype, self._fill(self._ids(block_ids))
        )
        tier = self.store.spill(key, source)
        self._blocks[key] = len(block_ids)
        return tier

    def spill(self, key: str, block_ids: list[int]) -> str | None:
        """A preempted request's blocks: room is made by dropping cached offloaded prefixes
        (make_room) before giving up; -> the tier's name, None (recompute) if none took them."""
        while True:
            try:
                return self.store_blocks(key, block_ids)
            except SpillFailed as e:
                if self.make_room is None or not self.make_room():
                    self.failed_spills += 1
                    log.warning("spill of %s failed, it will be recomputed: %s", key, e)
                    return None
                self.made_room += 1

    def reload(self, key: str, block_ids: list[int]) -> bool:
        """Unpack the entry into `block_ids` and drop it from its tier."""
        return self._read(key, block_ids, keep=False)

    def copy_back(self, key: str, block_ids: list[int]) -> bool:
        """Unpack the entry into `block_ids`; the entry stays (an offloaded prefix)."""
        return self._read(key, block_ids, keep=True)

    def _read(self, key: str, block_ids: list[int], keep: bool) -> bool:
        spilled = self._blocks.get(key) if keep else self._blocks.pop(key, None)
        if spilled is not None and spilled != len(block_ids):
            self.failed_reloads += 1
            if not keep:
                self.store.discard(key)
            log.warning("reload of %s: %d blocks spilled, %d given", key, spilled, len(block_ids))
            return False
        ids, pool, dim = self._ids(block_ids), self.kv.pool, self.kv.block_dim

        def sink(rows: torch.Tensor, start: int, stop: int) -> None:
            rows = rows.to(pool.device, non_blocking=True)
            self._unpack(pool, ids[start:stop], rows, dim)

        try:
            self.store.reload_into(key, sink, keep=keep)
        except ReloadFailed as e:
            self.failed_reloads += 1
            self._blocks.pop(key, None)
            log.warning("reload of %s failed, it will be recomputed: %s", key, e)
            return False
        return True

    def discard(self, key: str) -> None:
        self._blocks.pop(key, None)
        self.store.discard(key)

    def close(self) -> None:
        self.store.close()
