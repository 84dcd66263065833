"""Tiers in order (host -> CXL -> disk): where a new entry goes, and how one comes back.

    tier = place([host, cxl, disk], key, source)   # the first tier with room; SpillFailed if none
    read_into(tier, key, sink)                     # bit-exact, piece by piece; ReloadFailed if not

These are the byte-placement rules only. Which entries exist, under which keys, and when
they are dropped is decided above (pdserve/kv/offload.py owns that state); a tier itself
keeps only its entries' bytes. A tier that raises TierError on put (unwritable, full file
system) is skipped with a warning; SpillFailed means no tier could take the entry and the
caller must recompute. ReloadFailed means the bytes are gone or wrong: the caller must
recompute, never use them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence

import torch

from pdserve.registry import Registry
from transfer.tiers.base import BlockSource, Tier, TierError, TierFull
from transfer.tiers.disk import DiskTier
from transfer.tiers.memory import CXLTier, MemoryTier

log = logging.getLogger(__name__)

# tier kinds by the name spill flags and the preemption policies use
TIERS: Registry[type[Tier]] = Registry(
    "spill tier", {"host": MemoryTier, "cxl": CXLTier, "disk": DiskTier}
)


class SpillFailed(RuntimeError):
    """No tier could take the entry."""


class ReloadFailed(RuntimeError):
    """The entry could not be read back intact."""


def place(tiers: Sequence[Tier], key: Hashable, data: torch.Tensor | BlockSource) -> Tier:
    """Store `data` (a staging tensor, or a BlockSource packed straight into the tier that
    takes it) in the first tier with room -> that tier."""
    reasons = []
    for tier in tiers:
        began = tier.timer()
        try:
            tier.put(key, data)
        except TierFull as e:
            reasons.append(str(e))
            continue
        except TierError as e:
            log.warning("spill of %s skipped the %s tier: %s", key, tier.name, e)
            reasons.append(str(e))
            continue
        tier.stats.spill_s += tier.timer() - began
        return tier
    raise SpillFailed(f"no tier took {key!r}: " + "; ".join(reasons or ["no tiers"]))


def read_into(tier: Tier, key: Hashable, sink: Callable[[torch.Tensor, int, int], None]) -> int:
    """Hand the entry's blocks to sink(rows, start, stop) piece by piece (Tier.get_into);
    the entry stays in the tier. -> the number of blocks."""
    began = tier.timer()
    try:
        n = tier.get_into(key, sink)
    except TierError as e:
        log.warning("reload of %s from the %s tier failed: %s", key, tier.name, e)
        raise ReloadFailed(str(e)) from None
    tier.stats.reload_s += tier.timer() - began
    return n
