"""Spill tiers for live KV: host DRAM, CXL memory (real or emulated), local disk."""

from transfer.tiers.base import BlockSource, CorruptBlock, Tier, TierError, TierFull
from transfer.tiers.disk import DiskTier
from transfer.tiers.memory import CXLTier, MemoryTier
from transfer.tiers.store import TIERS, ReloadFailed, SpillFailed, place, read_into

__all__ = [
    "TIERS",
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
    "place",
    "read_into",
]
