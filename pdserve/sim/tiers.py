"""Spill tiers that keep the books and no bytes: the real OffloadedKV (pdserve/kv/offload.py)
parks and reloads through them exactly as through the real tiers (capacity in blocks, first
tier with room, TierFull when an entry does not fit), and each move charges its time to the
simulated clock instead of copying anything."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from pdserve.sim.clock import VirtualClock
from pdserve.sim.profile import TierCost
from transfer.tiers import BlockSource, Tier, TierError


class SimTier(Tier):
    def __init__(
        self, name: str, capacity_blocks: int, block_bytes: int, cost: TierCost, clock: VirtualClock
    ) -> None:
        super().__init__(capacity_blocks, block_bytes)
        self.name = name
        self.cost, self.clock = cost, clock
        self._entries: dict[Hashable, int] = {}  # key -> blocks
        self._used = 0

    def put(self, key: Hashable, data: torch.Tensor | BlockSource) -> None:
        n = self._check_put(key, data if isinstance(data, BlockSource) else BlockSource.of(data))
        self._entries[key] = n
        self._used += n
        nbytes = n * self.block_bytes
        self.stats.spills += 1
        self.stats.spilled_bytes += nbytes
        self.clock.charge(self.cost.seconds(nbytes, reload=False))

    def timer(self) -> float:
        return self.clock.elapsed()

    def get(self, key: Hashable) -> torch.Tensor:
        raise TierError("a simulated tier holds no bytes")

    def get_into(self, key: Hashable, sink: Callable[[torch.Tensor, int, int], None]) -> int:
        if key not in self._entries:
            raise TierError(f"{self.name} tier holds no entry {key!r}")
        n = self._entries[key]
        nbytes = n * self.block_bytes
        self.stats.reloads += 1
        self.stats.reloaded_bytes += nbytes
        self.clock.charge(self.cost.seconds(nbytes, reload=True))
        return n

    def discard(self, key: Hashable) -> None:
        n = self._entries.pop(key, None)
        if n is not None:
            self._used -= n

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    @property
    def used_blocks(self) -> int:
        return self._used

    def check_integrity(self) -> None:
        assert self._used == sum(self._entries.values()), f"{self.name}: used blocks drifted"
