"""The disk tier: spilled sequences as files in a private spill directory.

- The directory is created by this tier (mode 0700, under `root`, default the system temp
  directory) and removed with everything in it by close(); files are 0600.
- One file per entry, written with one large sequential write on a background thread, so
  `put` returns once the bytes are copied to a private buffer. A `get` of an entry still
  being written waits for it.
- Each block carries a CRC32 (zlib) taken at put time, in a header before the data; `get`
  verifies every block and raises CorruptBlock on a mismatch.
- Capacity is in blocks; `put` also refuses (TierFull) when the file system has less free
  space than the entry plus a margin, and raises TierError when the directory is not
  writable, so callers fall back (recompute) with a clear warning instead of crashing.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import struct
import tempfile
import threading
import zlib

import numpy as np
import torch

from transfer.tiers.base import CorruptBlock, Tier, TierError, TierFull

_MAGIC = b"PDSPILL1"
_HEAD = struct.Struct("<8sI")  # magic, JSON header length
FREE_SPACE_MARGIN = 64 << 20  # leave this much on the file system


class _Entry:
    def __init__(self, path: str, nblocks: int, shape, dtype: torch.dtype) -> None:
        self.path, self.nblocks, self.shape, self.dtype = path, nblocks, tuple(shape), dtype
        self.written = threading.Event()
        self.error: str | None = None


class DiskTier(Tier):
    name = "disk"

    def __init__(self, capacity_blocks: int, block_bytes: int, root: str | None = None) -> None:
        super().__init__(capacity_blocks, block_bytes)
        try:
            self.directory = tempfile.mkdtemp(prefix="pdserve-spill-", dir=root)  # 0700
        except OSError as e:
            raise TierError(f"disk tier: cannot create a spill directory in {root}: {e}") from None
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="spill-writer", daemon=True)
        self._writer.start()
        self._seq = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def used_blocks(self) -> int:
        return sum(e.nblocks for e in self._entries.values())

    def put(self, key: str, staging: torch.Tensor) -> None:
        n = self._check_put(key, staging)
        if not os.access(self.directory, os.W_OK | os.X_OK):
            self.stats.failures += 1
            raise TierError(f"disk tier: spill directory {self.directory} is not writable")
        nbytes = n * self.block_bytes
        if shutil.disk_usage(self.directory).free < nbytes + FREE_SPACE_MARGIN:
            self.stats.failures += 1
            raise TierFull(f"disk tier: the file system under {self.directory} is full")
        data = staging.detach().to("cpu", copy=True).contiguous()
        self._seq += 1
        entry = _Entry(
            os.path.join(self.directory, f"{self._seq:08d}.kv"), n, data.shape, data.dtype
        )
        with self._lock:
            self._entries[key] = entry
        self._queue.put((entry, data))
        self.stats.spills += 1
        self.stats.spilled_bytes += nbytes

    def flush(self) -> None:
        """Wait until every entry put so far is on disk (or failed)."""
        with self._lock:
            entries = list(self._entries.values())
        for entry in entries:
            entry.written.wait()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            entry, data = item
            raw = (
                data.view(torch.uint8).reshape(entry.nblocks, -1).numpy() if entry.nblocks else None
            )
            sums = [zlib.crc32(row) for row in raw] if raw is not None else []
            header = json.dumps(
                {"shape": entry.shape, "dtype": str(data.dtype), "crc32": sums}
            ).encode()
            try:
                fd = os.open(entry.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(_HEAD.pack(_MAGIC, len(header)) + header)
                    if raw is not None:
                        f.write(memoryview(raw).cast("B"))
            except OSError as e:
                entry.error = f"disk tier: writing {entry.path} failed: {e}"
            finally:
                entry.written.set()

    def get(self, key: str) -> torch.Tensor:
        entry = self._entries.get(key)
        if entry is None:
            raise TierError(f"disk tier holds no entry {key!r}")
        entry.written.wait()
        if entry.error is not None:
            self.stats.failures += 1
            raise TierError(entry.error)
        try:
            with open(entry.path, "rb") as f:
                blob = f.read()
        except OSError as e:
            self.stats.failures += 1
            raise TierError(f"disk tier: reading {entry.path} failed: {e}") from None
        header, body = None, b""
        if len(blob) >= _HEAD.size:
            magic, size = _HEAD.unpack_from(blob)
            try:
                header = (
                    json.loads(blob[_HEAD.size : _HEAD.size + size]) if magic == _MAGIC else None
                )
            except ValueError:
                header = None
            body = blob[_HEAD.size + size :]
        expected = entry.nblocks * self.block_bytes
        if header is None or len(body) != expected or len(header.get("crc32", [])) != entry.nblocks:
            self.stats.failures += 1
            raise CorruptBlock(f"disk tier: {entry.path} is truncated or not a spill file")
        raw = np.frombuffer(body, dtype=np.uint8).reshape(entry.nblocks, self.block_bytes)
        for i, (row, crc) in enumerate(zip(raw, header["crc32"])):
            if zlib.crc32(row) != crc:
                self.stats.failures += 1
                raise CorruptBlock(f"disk tier: block {i} of {key!r} fails its checksum")
        self.stats.reloads += 1
        self.stats.reloaded_bytes += expected
        data = torch.from_numpy(raw.copy()) if entry.nblocks else torch.empty(0, dtype=torch.uint8)
        return data.view(entry.dtype).reshape(entry.shape)

    def discard(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is not None:
            entry.written.wait()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)

    def check_integrity(self) -> None:
        files = {e.path for e in self._entries.values() if e.written.is_set() and not e.error}
        on_disk = {os.path.join(self.directory, f) for f in os.listdir(self.directory)}
        assert files <= on_disk, f"spill files missing: {sorted(files - on_disk)}"
        assert self.used_blocks <= self.capacity_blocks

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=30)
        self._entries.clear()
        shutil.rmtree(self.directory, ignore_errors=True)
