"""Tiers in order (host -> CXL -> disk): a spill goes to the first tier with room; a reload
comes from wherever the entry is and frees it there.

    store = TieredStore([MemoryTier(...), CXLTier(...), DiskTier(...)])
    tier = store.spill("req-7", staging)      # -> "host" | "cxl" | "disk"; SpillFailed if none
    staging = store.reload("req-7")           # bit-exact; ReloadFailed (corrupt / lost) otherwise

A tier that raises TierError on put (unwritable, full file system) is skipped with a
warning; SpillFailed means no tier could take the entry and the caller must recompute.
ReloadFailed means the bytes are gone or wrong: the caller must recompute, never use them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from transfer.tiers.base import BlockSource, Tier, TierError, TierFull

log = logging.getLogger(__name__)


class SpillFailed(RuntimeError):
    """No tier could take the entry."""


class ReloadFailed(RuntimeError):
    """The entry could not be read back intact."""


class TieredStore:
    def __init__(self, tiers: list[Tier]) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers: each tier kind at most once, got {names}")
        self.tiers = tiers
        self.where: dict[str, Tier] = {}

    def spill(self, key: str, data: torch.Tensor | BlockSource) -> str:
        """`data`: a staging tensor or a BlockSource (packed straight into the tier taking it).
        -> the name of that tier."""
        reasons = []
        for tier in self.tiers:
            try:
                tier.put(key, data)
            except TierFull as e:
                reasons.append(str(e))
                continue
            except TierError as e:
                log.warning("spill of %s skipped the %s tier: %s", key, tier.name, e)
                reasons.append(str(e))
                continue
            self.where[key] = tier
            return tier.name
        raise SpillFailed(f"no tier took {key!r}: " + "; ".join(reasons or ["no tiers"]))

    def reload(self, key: str) -> torch.Tensor:
        return self._take(key, lambda tier: tier.get(key))

    def reload_into(
        self, key: str, sink: Callable[[torch.Tensor, int, int], None], keep: bool = False
    ) -> int:
        """Like reload, but the blocks go to sink(rows, start, stop) piece by piece (see
        Tier.get_into): no intermediate copy. `keep`: the entry stays stored (unless it
        fails). -> the number of blocks."""
        return self._take(key, lambda tier: tier.get_into(key, sink), keep)

    def _take(self, key: str, read, keep: bool = False):
        tier = self.where.get(key) if keep else self.where.pop(key, None)
        if tier is None:
            raise ReloadFailed(f"{key!r} was not spilled")
        failed = True
        try:
            result = read(tier)
            failed = False
            return result
        except TierError as e:
            log.warning("reload of %s from the %s tier failed: %s", key, tier.name, e)
            raise ReloadFailed(str(e)) from None
        finally:
            if failed or not keep:
                self.where.pop(key, None)
                tier.discard(key)

    def discard(self, key: str) -> None:
        tier = self.where.pop(key, None)
        if tier is not None:
            tier.discard(key)

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def stats(self) -> dict[str, dict]:
        return {
            t.name: {
                **t.stats.__dict__,
                "used_blocks": t.used_blocks,
                "capacity": t.capacity_blocks,
            }
            for t in self.tiers
        }

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()
        for key, tier in self.where.items():
            assert key in tier, f"{key!r} is mapped to the {tier.name} tier but not in it"

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
        self.where.clear()
