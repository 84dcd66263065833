"""Offloaded KV: the one owner of every KV block kept outside the device pool.

Two kinds of entry, with typed keys that can never be confused with each other, whatever a
client names its requests:

    Parked(request_id)   a preempted request's computed blocks (every layer), kept until the
                         scheduler brings the request back (`unpark`) or it is aborted
    Prefix(hash)         one full block evicted from the device prefix cache, kept under its
                         chain hash so that a later prompt with the same prefix reloads it
                         instead of computing it (pdserve/kv/manager.py does the matching)

Prefix entries are a cache: least recently used first out, and a parked request always wins
over them (a park that finds no room drops prefixes until it fits or none is left).

Bytes move through the tiers of `transfer.tiers` in order (host, then CXL, then disk): a
park or a prefix packs the blocks straight into the first tier with room (one copy), a
reload unpacks straight from the tier into the given blocks. The arrow points one way:
this module decides what is kept and under which key; the tiers only store bytes.

    park(request_id, block_ids)   -> the tier's name, or None: no tier took it (recompute)
    unpark(request_id, block_ids) -> True, or False: lost or failed its checksum (recompute;
                                     wrong KV is never used)
    keep_prefix(block, h)         a cached block the allocator just evicted, still intact
    load_prefix(h, block)         -> True when the offloaded prefix block is now in `block`
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kernels.block_copy import pack_blocks, pack_blocks_ref, unpack_blocks, unpack_blocks_ref
from pdserve.failpoints import NO_FAILPOINTS, Failpoints
from pdserve.kv.kv_cache import KVCache
from transfer.tiers import BlockSource, ReloadFailed, SpillFailed, Tier, place, read_into

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parked:
    """A preempted request's KV."""

    request_id: str


@dataclass(frozen=True)
class Prefix:
    """One offloaded prefix block, named by the chain hash of the prefix it ends."""

    hash: int


Key = Parked | Prefix


@dataclass
class _Entry:
    tier: Tier
    blocks: int


@dataclass
class OffloadStats:
    parked: int = 0  # entries now
    prefixes: int = 0
    parks: int = 0  # ever
    failed_parks: int = 0  # no tier took a preempted request's KV
    failed_reloads: int = 0  # lost or corrupt: recomputed instead
    prefixes_dropped_for_parks: int = 0
    prefix_blocks_reloaded: int = 0
    tiers: dict[str, dict] = field(default_factory=dict)  # per tier: bytes, counts, used


class OffloadStore(Protocol):
    """What the KVManager needs of offloaded KV: OffloadedKV below moves real bytes; a
    simulator's store can keep the same books with no bytes at all."""

    def park(self, request_id: str, block_ids: list[int]) -> str | None: ...

    def unpark(self, request_id: str, block_ids: list[int]) -> bool: ...

    def drop_parked(self, request_id: str) -> None: ...

    def parked_blocks(self, request_id: str) -> int: ...

    def can_take(self, sizes: list[int]) -> bool: ...

    def copy_parked(self, request_id: str, into: torch.Tensor) -> bool: ...

    def keep_prefix(self, block: int, h: int) -> None: ...

    def load_prefix(self, h: int, block: int) -> bool: ...

    def stats(self) -> OffloadStats: ...

    def check_integrity(self, parked: Iterable[str] | None = None) -> None: ...

    def close(self) -> None: ...


class OffloadedKV:
    def __init__(
        self, cache: KVCache, tiers: list[Tier], failpoints: Failpoints = NO_FAILPOINTS
    ) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers: each tier kind at most once, got {names}")
        self.cache = cache
        self.tiers = tiers
        self.failpoints = failpoints
        self._entries: dict[Key, _Entry] = {}
        self._prefixes: OrderedDict[int, None] = OrderedDict()  # offloaded hashes, LRU first
        pool = cache.pool
        self._cuda = pool.device.type == "cuda"
        self._unpack = unpack_blocks if self._cuda else unpack_blocks_ref
        # a staging row: one block of every plane (layer x K/V), see kernels/block_copy.py
        dim = cache.block_dim
        self._row_shape = (math.prod(pool.shape[:dim]), math.prod(pool.shape[dim + 1 :]))
        self._stats = OffloadStats()

    # -- parked requests ------------------------------------------------------------------
    def park(self, request_id: str, block_ids: list[int]) -> str | None:
        """Keep a preempted request's blocks; dropping offloaded prefixes makes room first.
        -> the tier's name, or None when nothing could take them (the caller recomputes)."""
        key = Parked(request_id)
        assert key not in self._entries, f"request {request_id!r} is parked already"
        self.failpoints.hit("kv.spill", request_id)
        while True:
            try:
                tier = self._store(key, block_ids)
            except SpillFailed as e:
                if self._drop_oldest_prefix():
                    self._stats.prefixes_dropped_for_parks += 1
                    continue
                self._stats.failed_parks += 1
                log.warning("spill of %s failed, it will be recomputed: %s", request_id, e)
                return None
            self._stats.parks += 1
            return tier

    def unpark(self, request_id: str, block_ids: list[int]) -> bool:
        """Unpack the request's blocks into `block_ids` and drop the entry."""
        self.failpoints.hit("kv.reload", request_id)
        return self._read(Parked(request_id), block_ids, keep=False)

    def drop_parked(self, request_id: str) -> None:
        self._discard(Parked(request_id))

    def parked_blocks(self, request_id: str) -> int:
        """How many blocks a parked request's entry holds (0: none)."""
        entry = self._entries.get(Parked(request_id))
        return entry.blocks if entry is not None else 0

    def can_take(self, sizes: list[int]) -> bool:
        """Whether parks of these many blocks, in order, would each find a tier with room
        (each entry goes whole to the first tier that has it: transfer/tiers/store.py place)
        without dropping offloaded prefixes."""
        room = [t.capacity_blocks - t.used_blocks for t in self.tiers]
        for n in sizes:
            k = next((i for i, free in enumerate(room) if free >= n), None)
            if k is None:
                return False
            room[k] -= n
        return True

    def copy_parked(self, request_id: str, into: torch.Tensor) -> bool:
        """Unpack a parked request's blocks into `into` (shaped like the pool with exactly
        as many blocks: a live migration's staging buffer, decode/migrate.py), keeping the
        entry. False when it is lost or fails its checksum (then the entry is gone)."""
        n = into.shape[self.cache.block_dim]
        return self._read(Parked(request_id), list(range(n)), keep=True, pool=into)

    def is_parked(self, request_id: str) -> bool:
        return Parked(request_id) in self._entries

    def parked_ids(self) -> set[str]:
        return {k.request_id for k in self._entries if isinstance(k, Parked)}

    # -- offloaded prefixes ---------------------------------------------------------------
    def keep_prefix(self, block: int, h: int) -> None:
        """`block` (hash h) leaves the device cache: copy it out unless h is kept already.
        With no room anywhere, even after dropping older prefixes, it is simply forgotten."""
        if h in self._prefixes:
            self._prefixes.move_to_end(h)
            return
        while True:
            try:
                self._store(Prefix(h), [block])
            except SpillFailed:
                if self._drop_oldest_prefix():
                    continue
                return
            self._prefixes[h] = None
            return

    def has_prefix(self, h: int) -> bool:
        return h in self._prefixes

    def drop_prefix(self, h: int) -> None:
        self._discard(Prefix(h))

    def load_prefix(self, h: int, block: int) -> bool:
        """Copy the offloaded block of hash h into `block` (the entry stays). False when it
        is not kept or fails its checksum (then it is forgotten: compute from here)."""
        if h not in self._prefixes or not self._read(Prefix(h), [block], keep=True):
            return False  # a failed read dropped the entry
        self._prefixes.move_to_end(h)
        self._stats.prefix_blocks_reloaded += 1
        return True

    def _drop_oldest_prefix(self) -> bool:
        if not self._prefixes:
            return False
        h, _ = self._prefixes.popitem(last=False)
        self._discard(Prefix(h))
        return True

    # -- bytes ----------------------------------------------------------------------------
    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        # on the host: the pack and unpack check them there and copy them over without
        # waiting for the device (kernels/block_copy.py)
        return torch.tensor(block_ids, dtype=torch.int32)

    def _fill(self, ids: torch.Tensor) -> Callable[[torch.Tensor, int, int], None]:
        pool, dim = self.cache.pool, self.cache.block_dim

        def fill(out: torch.Tensor, start: int, stop: int) -> None:
            if self._cuda:
                out.copy_(pack_blocks(pool, ids[start:stop], dim))
            else:
                pack_blocks_ref(pool, ids[start:stop], dim, out=out)

        return fill

    def _store(self, key: Key, block_ids: list[int]) -> str:
        source = BlockSource(
            len(block_ids), self._row_shape, self.cache.pool.dtype, self._fill(self._ids(block_ids))
        )
        tier = place(self.tiers, key, source)
        self._entries[key] = _Entry(tier, len(block_ids))
        return tier.name

    def _read(
        self, key: Key, block_ids: list[int], keep: bool, pool: torch.Tensor | None = None
    ) -> bool:
        entry = self._entries.get(key)
        if entry is None:
            self._stats.failed_reloads += 1
            log.warning("reload of %s: nothing is kept under that key", key)
            return False
        if entry.blocks != len(block_ids):
            self._stats.failed_reloads += 1
            self._discard(key)
            log.warning("reload of %s: %d blocks kept, %d given", key, entry.blocks, len(block_ids))
            return False
        pool = self.cache.pool if pool is None else pool
        ids, dim = self._ids(block_ids), self.cache.block_dim

        def sink(rows: torch.Tensor, start: int, stop: int) -> None:
            rows = rows.to(pool.device, non_blocking=True)
            self._unpack(pool, ids[start:stop], rows, dim)

        try:
            read_into(entry.tier, key, sink)
        except ReloadFailed as e:
            self._stats.failed_reloads += 1
            self._discard(key)
            log.warning("reload of %s failed, it will be recomputed: %s", key, e)
            return False
        if not keep:
            self._discard(key)
        return True

    def _discard(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.tier.discard(key)
        if isinstance(key, Prefix):
            self._prefixes.pop(key.hash, None)

    # -- accounting -----------------------------------------------------------------------
    def stats(self) -> OffloadStats:
        s = self._stats
        parked = sum(isinstance(k, Parked) for k in self._entries)
        tiers = {
            t.name: {
                **t.stats.__dict__,
                "used_blocks": t.used_blocks,
                "capacity": t.capacity_blocks,
                "block_bytes": t.block_bytes,
            }
            for t in self.tiers
        }
        return OffloadStats(
            parked=parked,
            prefixes=len(self._prefixes),
            parks=s.parks,
            failed_parks=s.failed_parks,
            failed_reloads=s.failed_reloads,
            prefixes_dropped_for_parks=s.prefixes_dropped_for_parks,
            prefix_blocks_reloaded=s.prefix_blocks_reloaded,
            tiers=tiers,
        )

    def check_integrity(self, parked: Iterable[str] | None = None) -> None:
        """Every entry is in its tier, each tier holds exactly its entries' blocks, the
        prefix LRU and the prefix entries agree, and (when given) the parked entries are
        exactly the given requests."""
        per_tier: dict[str, int] = {t.name: 0 for t in self.tiers}
        for key, entry in self._entries.items():
            assert key in entry.tier, f"{key} is mapped to the {entry.tier.name} tier but not in it"
            per_tier[entry.tier.name] += entry.blocks
        for tier in self.tiers:
            tier.check_integrity()
            held = per_tier[tier.name]
            assert tier.used_blocks == held, (
                f"{tier.name} tier holds {tier.used_blocks} blocks, its entries {held}"
            )
        prefixes = {k.hash for k in self._entries if isinstance(k, Prefix)}
        assert prefixes == set(self._prefixes), "prefix LRU and prefix entries disagree"
        if parked is not None:
            assert self.parked_ids() == set(parked), (
                f"parked KV {sorted(self.parked_ids())} != parked requests {sorted(set(parked))}"
            )

    def close(self) -> None:
        """Release every tier (the disk tier's directory goes with it)."""
        for tier in self.tiers:
            tier.close()
        self._entries.clear()
        self._prefixes.clear()
