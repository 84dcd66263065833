"""What every spill tier offers: put a sequence's packed KV blocks under a key, get them back
bit-exact (or learn that they are gone or corrupt), discard, account.

A tier stores *staging* tensors `[n, planes, block_elems]` (see kernels/block_copy.py: row i
is one block of every layer, contiguous), keyed by the caller (a request id). Capacity is in
blocks; `put` raises TierFull when the entry does not fit (the caller tries the next tier or
recomputes) and TierError when the tier cannot take data at all (unwritable, I/O failure).
`get` raises CorruptBlock when a block fails its checksum: the caller must recompute, never
serve those bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class TierFull(RuntimeError):
    """No room for this entry in this tier."""


class TierError(RuntimeError):
    """The tier cannot store or return data (unwritable directory, I/O error, lost entry)."""


class CorruptBlock(TierError):
    """A block read back does not match the checksum taken when it was spilled."""


@dataclass
class TierStats:
    spilled_bytes: int = 0
    reloaded_bytes: int = 0
    spills: int = 0
    reloads: int = 0
    failures: int = 0


class Tier(ABC):
    name: str

    def __init__(self, capacity_blocks: int, block_bytes: int) -> None:
        if capacity_blocks < 0 or block_bytes <= 0:
            raise ValueError("capacity_blocks must be >= 0 and block_bytes > 0")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.stats = TierStats()

    @abstractmethod
    def put(self, key: str, staging: torch.Tensor) -> None: ...

    @abstractmethod
    def get(self, key: str) -> torch.Tensor:
        """The staging tensor stored under `key` (CPU); the entry stays until discard().
        The result may be a view into the tier's own memory, valid until the next put."""

    @abstractmethod
    def discard(self, key: str) -> None: ...

    @abstractmethod
    def __contains__(self, key: str) -> bool: ...

    @property
    @abstractmethod
    def used_blocks(self) -> int: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release everything (files, memory)."""

    def check_integrity(self) -> None:  # noqa: B027 - optional hook
        """Accounting invariants; raises AssertionError."""

    def _check_put(self, key: str, staging: torch.Tensor) -> int:
        if key in self:
            raise ValueError(f"key {key!r} is already stored in the {self.name} tier")
        if staging.dim() != 3 or not staging.is_contiguous():
            raise ValueError("staging must be a contiguous [n, planes, block_elems] tensor")
        n = staging.shape[0]
        if staging[0].numel() * staging.element_size() != self.block_bytes if n else False:
            raise ValueError(
                f"a staging row holds {staging[0].numel() * staging.element_size()} bytes, "
                f"this tier's blocks {self.block_bytes}"
            )
        if self.used_blocks + n > self.capacity_blocks:
            raise TierFull(
                f"{self.name} tier: {n} blocks do not fit "
                f"({self.used_blocks}/{self.capacity_blocks} used)"
            )
        return n
