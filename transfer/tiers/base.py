"""What every spill tier offers: put a sequence's packed KV blocks under a key, get them back
bit-exact (or learn that they are gone or corrupt), discard, account.

A tier stores *staging* tensors `[n, planes, block_elems]` (see kernels/block_copy.py: row i
is one block of every layer, contiguous), under a hashable key the caller chooses. `put` takes
either such a tensor or a BlockSource, which packs blocks on demand straight into memory the
tier chooses (its own slots, its writer's buffer): a spill is then one copy, not two. Capacity is in
blocks; `put` raises TierFull when the entry does not fit (the caller tries the next tier or
recomputes) and TierError when the tier cannot take data at all (unwritable, I/O failure).
`get` raises CorruptBlock when a block fails its checksum: the caller must recompute, never
serve those bytes.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch


class TierFull(RuntimeError):
    """No room for this entry in this tier."""


class TierError(RuntimeError):
    """The tier cannot store or return data (unwritable directory, I/O error, lost entry)."""


class CorruptBlock(TierError):
    """A block read back does not match the checksum taken when it was spilled."""


@dataclass(frozen=True)
class BlockSource:
    """n blocks to store, packed on demand: fill(out, start, stop) writes blocks [start, stop)
    of the sequence as the rows of `out`, a contiguous [stop - start, *row_shape] tensor."""

    n: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    fill: Callable[[torch.Tensor, int, int], None]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n, *self.row_shape)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * torch.empty((), dtype=self.dtype).element_size()

    @staticmethod
    def of(staging: torch.Tensor) -> BlockSource:
        """A source for blocks that are already packed (a staging tensor, on any device)."""
        if staging.dim() != 3 or not staging.is_contiguous():
            raise ValueError("staging must be a contiguous [n, planes, block_elems] tensor")
        return BlockSource(
            staging.shape[0],
            tuple(staging.shape[1:]),
            staging.dtype,
            lambda out, start, stop: out.copy_(staging[start:stop]),
        )


def as_source(data: torch.Tensor | BlockSource) -> BlockSource:
    return data if isinstance(data, BlockSource) else BlockSource.of(data)


@dataclass
class TierStats:
    spilled_bytes: int = 0
    reloaded_bytes: int = 0
    spills: int = 0
    reloads: int = 0
    failures: int = 0
    spill_s: float = 0.0  # time spent in successful puts (packing included) and gets
    reload_s: float = 0.0


class Tier(ABC):
    name: str

    def __init__(self, capacity_blocks: int, block_bytes: int) -> None:
        if capacity_blocks < 0 or block_bytes <= 0:
            raise ValueError("capacity_blocks must be >= 0 and block_bytes > 0")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.stats = TierStats()

    def timer(self) -> float:
        """The clock spill and reload times are measured on (a simulated tier's is virtual)."""
        return time.perf_counter()

    @abstractmethod
    def put(self, key: Hashable, data: torch.Tensor | BlockSource) -> None:
        """Store the blocks under `key` (a staging tensor, or a source packed into the tier's
        own memory). Raises TierFull / TierError; nothing is stored then."""

    @abstractmethod
    def get(self, key: Hashable) -> torch.Tensor:
        """The staging tensor stored under `key` (CPU); the entry stays until discard().
        The result may be a view into the tier's own memory, valid until the next put."""

    def get_into(self, key: Hashable, sink: Callable[[torch.Tensor, int, int], None]) -> int:
        """Hand the entry's blocks to sink(rows, start, stop) (rows: [stop - start, planes,
        block_elems], valid only during the call), in one or more pieces; -> the number of
        blocks. Raises like get(); a sink may have seen earlier pieces when a later one fails
        its checksum, so the caller must treat everything it wrote as garbage then."""
        data = self.get(key)
        sink(data, 0, data.shape[0])
        return data.shape[0]

    @abstractmethod
    def discard(self, key: Hashable) -> None: ...

    @abstractmethod
    def __contains__(self, key: Hashable) -> bool: ...

    @property
    @abstractmethod
    def used_blocks(self) -> int: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release everything (files, memory)."""

    def check_integrity(self) -> None:  # noqa: B027 - optional hook
        """Accounting invariants; raises AssertionError."""

    def _check_put(self, key: Hashable, source: BlockSource) -> int:
        if key in self:
            raise ValueError(f"key {key!r} is already stored in the {self.name} tier")
        if len(source.row_shape) != 2:
            raise ValueError("blocks must be [n, planes, block_elems]")
        n = source.n
        if n and source.row_bytes != self.block_bytes:
            raise ValueError(
                f"a staging row holds {source.row_bytes} bytes, this tier's blocks "
                f"{self.block_bytes}"
            )
        if self.used_blocks + n > self.capacity_blocks:
            raise TierFull(
                f"{self.name} tier: {n} blocks do not fit "
                f"({self.used_blocks}/{self.capacity_blocks} used)"
            )
        return n
