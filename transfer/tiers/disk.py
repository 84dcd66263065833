"""The disk tier: spilled sequences as files in a private spill directory.

- The directory is created by this tier (mode 0700, under `root`, default the system temp
  directory) and removed with everything in it by close(); files are 0600.
- One file per entry, holding the blocks' bytes and nothing else. `put` packs the blocks
  (BlockSource) in pieces of about CHUNK_BYTES into a private, reused buffer and queues each
  piece for a background writer thread, which writes it with one large sequential write:
  packing the next piece overlaps writing the last. `put` returns once everything is packed;
  a `get` of an entry still being written waits for it.
- Each block gets a 64-bit xxh3 checksum as soon as it is packed (still in cache). Checksums
  stay in this process's memory, not in the file, so a damaged file cannot carry a matching one.
  `get_into` reads the file back in pieces into a reused buffer, verifies each block and
  hands it on (to the unpack) while it is still in cache; a mismatch or a short file raises
  CorruptBlock.
- Capacity is in blocks; `put` also refuses (TierFull) when the file system has less free
  space than the entry plus a margin, and raises TierError when the directory is not
  writable, so callers fall back (recompute) with a clear warning instead of crashing.
- A process killed with SIGKILL runs no close(): its directory stays. Each directory holds
  an OWNER file (the creating process's pid and its start time, from /proc); a new disk
  tier first removes the directories under its root that are this user's, carry a valid
  OWNER file, and whose process is gone (no such pid, or a pid reused by a process that
  started at another time). Anything else there is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Hashable

import numpy as np
import torch
import xxhash

from pdserve.failpoints import NO_FAILPOINTS, Failpoints
from transfer.tiers.base import BlockSource, CorruptBlock, Tier, TierError, TierFull, as_source

log = logging.getLogger(__name__)
FREE_SPACE_MARGIN = 64 << 20  # leave this much on the file system
PREFIX = "pdserve-spill-"
OWNER = "OWNER"  # "<pid> <start time in clock ticks since boot>"
CHUNK_BYTES = 8 << 20  # pack / write / read pieces of about this size
KEEP_BUFFERS = 4  # write buffers kept for reuse (fresh memory costs page faults)

checksum = xxhash.xxh3_64_intdigest


class _Entry:
    def __init__(self, path: str, nblocks: int, shape, dtype: torch.dtype) -> None:
        self.path, self.nblocks, self.shape, self.dtype = path, nblocks, tuple(shape), dtype
        self.sums: list[int] = []  # per block, taken at put time
        self.written = threading.Event()
        self.error: str | None = None


class _Buffers:
    """Byte buffers handed to the writer and given back when it is done with them."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=lambda b: b.nbytes, reverse=True)
            del self._free[KEEP_BUFFERS:]  # keep the largest


class DiskTier(Tier):
    name = "disk"

    def __init__(
        self,
        capacity_blocks: int,
        block_bytes: int,
        root: str | None = None,
        failpoints: Failpoints = NO_FAILPOINTS,
    ) -> None:
        super().__init__(capacity_blocks, block_bytes)
        self.failpoints = failpoints
        self.removed_stale = remove_stale(root)
        for path in self.removed_stale:
            log.warning("removed the spill directory of a dead process: %s", path)
        try:
            self.directory = tempfile.mkdtemp(prefix=PREFIX, dir=root)  # 0700
            _write_owner(self.directory)
        except OSError as e:
            raise TierError(f"disk tier: cannot create a spill directory in {root}: {e}") from None
        # an engine nobody closed (a script's LLM) still leaves no spill files behind at exit
        self._remove_directory = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self._entries: dict[Hashable, _Entry] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._buffers = _Buffers()
        self._read_buffer = np.empty(0, dtype=np.uint8)
        self._writer = threading.Thread(target=self._write_loop, name="spill-writer", daemon=True)
        self._writer.start()
        self._seq = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    @property
    def used_blocks(self) -> int:
        return sum(e.nblocks for e in self._entries.values())

    def _rows_per_chunk(self) -> int:
        return max(1, CHUNK_BYTES // self.block_bytes)

    def put(self, key: Hashable, data: torch.Tensor | BlockSource) -> None:
        source = as_source(data)
        n = self._check_put(key, source)
        if not os.access(self.directory, os.W_OK | os.X_OK):
            self.stats.failures += 1
            raise TierError(f"disk tier: spill directory {self.directory} is not writable")
        nbytes = n * self.block_bytes
        if shutil.disk_usage(self.directory).free < nbytes + FREE_SPACE_MARGIN:
            self.stats.failures += 1
            raise TierFull(f"disk tier: the file system under {self.directory} is full")
        self._seq += 1
        path = os.path.join(self.directory, f"{self._seq:08d}.kv")
        entry = _Entry(path, n, source.shape, source.dtype)
        buffer = self._buffers.take(nbytes)
        rows = torch.from_numpy(buffer[:nbytes]).view(n, self.block_bytes)
        self._queue.put(("open", entry, None))
        try:
            per = self._rows_per_chunk()
            for start in range(0, n, per):
                stop = min(n, start + per)
                piece = rows[start:stop]
                out = piece.view(source.dtype).view(stop - start, *source.row_shape)
                source.fill(out, start, stop)
                # checksums while the piece is still in cache; the writer only writes
                raw = piece.numpy()
                entry.sums += [checksum(row) for row in raw]
                self._queue.put(("write", entry, raw))
        except BaseException:
            entry.error = "disk tier: packing the entry failed"
            self._queue.put(("close", entry, buffer))
            entry.written.wait()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        self._queue.put(("close", entry, buffer))
        with self._lock:
            self._entries[key] = entry
        self.stats.spills += 1
        self.stats.spilled_bytes += nbytes

    def flush(self) -> None:
        """Wait until every entry put so far is on disk (or failed)."""
        with self._lock:
            entries = list(self._entries.values())
        for entry in entries:
            entry.written.wait()

    def _write_loop(self) -> None:
        files: dict[_Entry, object] = {}
        while True:
            item = self._queue.get()
            if item is None:
                return
            op, entry, data = item
            try:
                if op == "open" and entry.error is None:
                    fd = os.open(entry.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    files[entry] = os.fdopen(fd, "wb", buffering=0)
                elif op == "write" and entry.error is None:
                    if self.failpoints.hit("disk.write", entry.path) == "error":
                        raise OSError(errno.ENOSPC, "No space left on device (failpoint)")
                    view, f = memoryview(data).cast("B"), files[entry]
                    while view:
                        view = view[f.write(view) :]
            except OSError as e:
                entry.error = f"disk tier: writing {entry.path} failed: {e}"
            if op == "close":
                f = files.pop(entry, None)
                if f is not None:
                    try:
                        f.close()
                    except OSError as e:
                        entry.error = entry.error or f"disk tier: closing {entry.path} failed: {e}"
                self._buffers.give(data)
                entry.written.set()

    def get_into(self, key: Hashable, sink: Callable[[torch.Tensor, int, int], None]) -> int:
        """Read the entry back in pieces; every block is verified before `sink` sees it.
        The pieces are views of a reused buffer, valid only during the call."""
        entry = self._entries.get(key)
        if entry is None:
            raise TierError(f"disk tier holds no entry {key!r}")
        entry.written.wait()
        if entry.error is not None:
            self.stats.failures += 1
            raise TierError(entry.error)
        n, bb = entry.nblocks, self.block_bytes
        per = self._rows_per_chunk()
        if self._read_buffer.nbytes < min(n, per) * bb:
            self._read_buffer = np.empty(min(n, per) * bb, dtype=np.uint8)
        try:
            with open(entry.path, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != n * bb:
                    self.stats.failures += 1
                    raise CorruptBlock(f"disk tier: {entry.path} is truncated or not a spill file")
                for start in range(0, n, per):
                    stop = min(n, start + per)
                    piece = self._read_buffer[: (stop - start) * bb]
                    view = memoryview(piece)
                    while view:
                        got = f.readinto(view)
                        if not got:
                            self.stats.failures += 1
                            raise CorruptBlock(f"disk tier: {entry.path} is truncated")
                        view = view[got:]
                    rows = piece.reshape(stop - start, bb)
                    for i, row in enumerate(rows, start):
                        if checksum(row) != entry.sums[i]:
                            self.stats.failures += 1
                            raise CorruptBlock(
                                f"disk tier: block {i} of {key!r} fails its checksum"
                            )
                    sink(
                        torch.from_numpy(rows)
                        .view(entry.dtype)
                        .view(stop - start, *entry.shape[1:]),
                        start,
                        stop,
                    )
        except OSError as e:
            self.stats.failures += 1
            raise TierError(f"disk tier: reading {entry.path} failed: {e}") from None
        self.stats.reloads += 1
        self.stats.reloaded_bytes += n * bb
        return n

    def get(self, key: Hashable) -> torch.Tensor:
        entry = self._entries.get(key)
        if entry is None:
            raise TierError(f"disk tier holds no entry {key!r}")
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.get_into(key, lambda rows, start, stop: out[start:stop].copy_(rows))
        return out

    def discard(self, key: Hashable) -> None:
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
        self._remove_directory()


# ---------------------------------------------------------------- dead predecessors


def _started(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _write_owner(directory: str) -> None:
    fd = os.open(os.path.join(directory, OWNER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()} {_started(os.getpid())}\n")


def _stale(directory: str) -> bool:
    """Ours (this user's, with a well-formed OWNER) and its process gone."""
    try:
        if os.stat(directory).st_uid != os.getuid():
            return False
        with open(os.path.join(directory, OWNER)) as f:
            pid_text, started_text = f.read().split()
        pid, started = int(pid_text), int(started_text)
    except (OSError, ValueError):
        return False  # no OWNER, unreadable or malformed: not provably ours
    return _started(pid) != started


def remove_stale(root: str | None) -> list[str]:
    """Removes the spill directories of dead pdserve processes under `root` (default: the
    system temp directory) -> the ones removed. Linux (/proc); elsewhere nothing."""
    root = root or tempfile.gettempdir()
    if not os.path.isdir("/proc/self"):
        return []
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path) and _stale(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
