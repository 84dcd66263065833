"""Memory tiers: host DRAM (pinned on CUDA machines, so reloads are asynchronous DMA) and
CXL-attached memory.

Both keep one preallocated byte pool cut into block slots; an entry occupies any free slots
(a slot table per key), so the pool never fragments. The CXL tier is a second such pool
with its own capacity. It is backed by a file or DAX device path (`path`, mapped
shared) where a CXL memory device exists (file-backed mapping is tested; a real DAX device
has not been available to this project); without one it is an anonymous buffer and reports
`emulated = True`. Its `bandwidth_gb_s` and `latency_us` model the slower memory: each put
and get takes at least latency + bytes / bandwidth (the copy itself, then a sleep for the
rest), so policies see the cost a real CXL expander would have.
"""

from __future__ import annotations

import mmap
import os
import stat
import time
from collections.abc import Hashable

import torch

from transfer.tiers.base import BlockSource, Tier, TierError, as_source


def _runs(slots: list[int]):
    """(start, stop) index ranges of `slots` whose values are consecutive."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield start, i
            start = i


class MemoryTier(Tier):
    name = "host"

    def __init__(
        self,
        capacity_blocks: int,
        block_bytes: int,
        pin: bool | None = None,
        buffer: torch.Tensor | None = None,
    ) -> None:
        super().__init__(capacity_blocks, block_bytes)
        if buffer is None:
            pin = torch.cuda.is_available() if pin is None else pin
            buffer = torch.empty(capacity_blocks * block_bytes, dtype=torch.uint8, pin_memory=pin)
        self.slots = buffer.view(capacity_blocks, block_bytes)
        self._free = list(range(capacity_blocks - 1, -1, -1))  # pop() gives the lowest
        self._entries: dict[Hashable, tuple[list[int], torch.Size, torch.dtype]] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    @property
    def used_blocks(self) -> int:
        return self.capacity_blocks - len(self._free)

    def put(self, key: Hashable, data: torch.Tensor | BlockSource) -> None:
        """The blocks are packed straight into the slots (one copy), one run of consecutive
        slots at a time: a single run in the usual case."""
        source = as_source(data)
        n = self._check_put(key, source)
        slots = [self._free.pop() for _ in range(n)]
        try:
            for start, stop in _runs(slots):
                first = slots[start]
                rows = self.slots[first : first + stop - start]
                source.fill(
                    rows.view(source.dtype).view(stop - start, *source.row_shape), start, stop
                )
        except BaseException:
            self._free.extend(slots)
            self._free.sort(reverse=True)
            raise
        self._entries[key] = (slots, source.shape, source.dtype)
        self.stats.spills += 1
        self.stats.spilled_bytes += n * self.block_bytes

    def get(self, key: Hashable) -> torch.Tensor:
        """May be a view into the tier's memory: use it before the next put."""
        slots, shape, dtype = self._entry(key)
        if slots and slots[-1] - slots[0] == len(slots) - 1:
            data = self.slots[slots[0] : slots[0] + len(slots)]  # a view: no copy
        else:
            data = self.slots[torch.tensor(slots, dtype=torch.long)] if slots else self.slots[:0]
        self._account_get(len(slots))
        return data.view(dtype).reshape(shape)

    def get_into(self, key: Hashable, sink) -> int:
        """The sink reads each run of consecutive slots in place: no intermediate copy."""
        slots, shape, dtype = self._entry(key)
        for start, stop in _runs(slots):
            rows = self.slots[slots[start] : slots[start] + stop - start]
            sink(rows.view(dtype).view(stop - start, *shape[1:]), start, stop)
        self._account_get(len(slots))
        return len(slots)

    def _entry(self, key: Hashable):
        if key not in self._entries:
            raise TierError(f"{self.name} tier holds no entry {key!r}")
        return self._entries[key]

    def _account_get(self, n: int) -> None:
        self.stats.reloads += 1
        self.stats.reloaded_bytes += n * self.block_bytes

    def discard(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._free.extend(entry[0])
            self._free.sort(reverse=True)

    def check_integrity(self) -> None:
        held = [s for slots, _, _ in self._entries.values() for s in slots]
        assert len(held) == len(set(held)), "a slot belongs to two entries"
        assert not set(held) & set(self._free), "a held slot is on the free list"
        assert len(held) + len(self._free) == self.capacity_blocks, "a slot is lost"


class CXLTier(MemoryTier):
    name = "cxl"

    def __init__(
        self,
        capacity_blocks: int,
        block_bytes: int,
        path: str | None = None,
        bandwidth_gb_s: float = 32.0,
        latency_us: float = 0.4,
    ) -> None:
        if bandwidth_gb_s <= 0 or latency_us < 0:
            raise ValueError("bandwidth_gb_s must be > 0 and latency_us >= 0")
        self.path = path
        self.emulated = path is None
        self.bandwidth_gb_s, self.latency_us = bandwidth_gb_s, latency_us
        self._map = None
        buffer = None
        if path is not None:
            size = capacity_blocks * block_bytes
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    mode = os.fstat(fd).st_mode
                    device = stat.S_ISCHR(mode) or stat.S_ISBLK(mode)  # e.g. /dev/dax0.0
                    if not device and os.fstat(fd).st_size < size:
                        os.ftruncate(fd, size)
                    self._map = mmap.mmap(fd, size, mmap.MAP_SHARED)
                finally:
                    os.close(fd)
            except OSError as e:
                raise TierError(f"cxl tier: cannot map {path}: {e}") from None
            buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        super().__init__(capacity_blocks, block_bytes, pin=False, buffer=buffer)

    def _pace(self, start: float, nbytes: int) -> None:
        due = start + self.latency_us * 1e-6 + nbytes / (self.bandwidth_gb_s * 1e9)
        rest = due - time.perf_counter()
        if rest > 0:
            time.sleep(rest)

    def put(self, key: Hashable, data: torch.Tensor | BlockSource) -> None:
        start = time.perf_counter()
        source = as_source(data)
        super().put(key, source)
        self._pace(start, source.n * self.block_bytes)

    def get(self, key: Hashable) -> torch.Tensor:
        """A copy of the entry out of CXL memory into DRAM."""
        start = time.perf_counter()
        data = super().get(key).clone()
        self._pace(start, data.numel() * data.element_size())
        return data

    def get_into(self, key: Hashable, sink) -> int:
        """The sink (the unpack) reads straight from CXL memory, as a load or DMA from a
        real expander would; the pacing covers that copy."""
        start = time.perf_counter()
        n = super().get_into(key, sink)
        self._pace(start, n * self.block_bytes)
        return n

    def close(self) -> None:
        self.slots = None  # the only view of the mapping
        if self._map is not None:
            self._map.close()
            self._map = None
