"""Spill tiers for live KV: host DRAM, CXL memory (real or emulated), local disk."""

from transfer.tiers.base import BlockSource, CorruptBlock, Tier, TierError, TierFull
from transfer.tiers.disk import DiskTier
from transfer.tiers.memory import CXLTier, MemoryTier
from transfer.tiers.store import ReloadFailed, SpillFailed, TieredStore

__all__ = [
    "BlockSource",
    "CXLTier",
    "CorruptBlock",
    "DiskTier",
    "MemoryTier",
    "ReloadFailed",
    "SpillFailed",
    "Tier",
    "TierError",
    "TierFull",
    "TieredStore",
]
