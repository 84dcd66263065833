"""Workers on one CPU node that take turns at all of its cores, instead of splitting them.

On a CPU node every worker's forward pass is an OpenMP team that spins between parallel
regions; two teams on the same cores (a prefill and a decode worker, each given every CPU)
preempt each other inside regions and both crawl, and splitting the cores between them
leaves a worker's share idle whenever it has nothing to do (a decode worker waiting for
prompts, a prefill worker between bursts). With a lease, each worker's team spans every
core, and a worker computes only while it holds the lease: one forward pass at a time (a
decode step, a prefill batch), then the turn passes to a worker that is waiting, if any.

    lease = CpuLease.open("/dev/shm/pdserve-<cluster>/cpu")  # every worker of the node
    with lease.turn():
        core.run(plan)

A lease opened `shared` takes turns that may overlap with other shared turns, never with an
exclusive one: decode workers share (each on its part of the cores: their steps are small
and scale poorly with threads, so two of them side by side beat two in a row), a prefill
worker's batch takes every core alone. A shared turn does not start while an exclusive
worker waits (a gate file it holds while it waits), so prefill is not starved by decode
steps that overlap one another.

The lock is `flock` on a file (the kernel drops it when a holder dies). Turns are fair
between processes: a holder that releases while another worker waits does not take the lock
again until that worker has had a turn (per-worker turn counters in a small mapped file,
summed, and each worker's "waiting" flag in its own byte). A worker's slot is claimed with
a lock on a file of its own, so a dead worker's stale flag is recognised and ignored.

A worker that dies holding the lease frees it (the kernel drops its lock); one that hangs
holding it must not stop its neighbours. A stopped holder (SIGSTOP, a debugger) is seen at
two looks in a row, STOPPED_CHECK_S apart: the holders are the kernel's own record, the
flock lines of the gate and the lock files in /proc/locks (a worker that waits for one is
not listed as holding it, and one stopped while it waited leaves the queue), each looked
up in /proc/<pid>/stat. (Pids that workers wrote into the state file were not exact: a
worker stopped as its flock() returned, before it wrote its pid, held the gate unnamed,
and a prefill worker waited out the stall timeout behind it.) Any other wait longer than
`stall_timeout_s` (a stuck step) gives up too. Either way the waiter logs it and computes
without the lease (its CPUs are idle: the holder is not computing either) until the lock
comes free again. Without /proc (not Linux) no holder is seen stopped: only the stall
timeout ends a wait.

Only an engine's driver takes the lease: tensor-parallel ranks compute in lockstep with it
(their collectives would deadlock on a lock their driver holds).
"""

from __future__ import annotations

import enum
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

SLOTS = 64  # workers that can share one lease
HANDOFF_TIMEOUT_S = 0.05  # a waiter that does not take its turn by then (it died) is skipped
# a holder that keeps the lease longer is stuck (a legitimate turn is one forward pass: a
# 2,048-token prefill batch takes seconds on a small CPU box, a minute for a 8B model)
STALL_TIMEOUT_S = 120.0
# a waiter looks this often whether a holder is a stopped process (twice in a row: gives up)
STOPPED_CHECK_S = 0.25
_POLL_S = 0.0002
# the state file, per slot: the turns its worker took (8 bytes; one writer each, so shared
# turns taken at once lose no count), its waiting flag (a byte)
_TURNS = 0
_FLAGS = 8 * SLOTS
_SIZE = 9 * SLOTS
_PER_SLOT = struct.Struct(f"<{SLOTS}Q")  # the turns of every slot
log = logging.getLogger(__name__)


class LeaseUnavailable(RuntimeError):
    """Every slot of the lease is taken (retrying will not help until a worker exits)."""


class _Phase(enum.Enum):
    """Where this worker's side of the lease is. A blocking flock() has no timeout, so a
    contended one runs on a thread of the lease's own (started at the first) while the
    caller waits on an event with a deadline."""

    IDLE = "idle"  # no flock() under way, the lock not held
    WAITING = "waiting"  # the thread is in flock() for a caller that waits
    ABANDONED = "abandoned"  # its caller gave up: the lock is let go as soon as it is got
    HELD = "held"
    CLOSED = "closed"


class CpuLease:
    def __init__(
        self,
        fds: tuple[int, int, int],
        slot: int,
        state: mmap.mmap,
        base: str,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        shared: bool = False,
    ):
        self._lock_fd, self._gate_fd, self._slot_fd = fds
        self.slot = slot
        self._mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        self._flag = _FLAGS + slot  # this worker's waiting flag in the state file
        self._turn = _field(_TURNS, slot)  # and its turns
        self._state = state
        self._base = base
        self.stall_timeout_s = stall_timeout_s
        self._mu = threading.Lock()  # the phase, and the lock's non-blocking calls
        self._phase = _Phase.IDLE
        self._request = threading.Event()
        self._granted = threading.Event()
        self._waiter: threading.Thread | None = None

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        shared: bool = False,
    ) -> CpuLease:
        """Join the lease at `path` (its files are created beside it: `path`.lock, .gate,
        .state, .slotN); LeaseUnavailable when SLOTS workers hold it already. `shared`:
        this worker's turns may overlap with those of other shared workers (never with an
        exclusive worker's)."""
        base = str(path)
        Path(base).parent.mkdir(parents=True, exist_ok=True)
        lock_fd = _open(base + ".lock")
        gate_fd = slot_fd = None
        try:
            gate_fd = _open(base + ".gate")
            slot, slot_fd = _claim_slot(base)
            state_fd = _open(base + ".state")
            try:
                if os.fstat(state_fd).st_size < _SIZE:
                    os.ftruncate(state_fd, _SIZE)  # zeros; a second one to it: no-op
                state = mmap.mmap(state_fd, _SIZE)
            finally:
                os.close(state_fd)
        except BaseException:
            for fd in (lock_fd, gate_fd, slot_fd):
                if fd is not None:
                    os.close(fd)
            raise
        state[_FLAGS + slot] = 0  # a dead worker's flag in this slot is not ours
        return cls((lock_fd, gate_fd, slot_fd), slot, state, base, stall_timeout_s, shared)

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold every core for the body (or, past a stuck holder, run it without)."""
        held = self.acquire()
        try:
            yield
        finally:
            if held:
                self.release()

    def acquire(self) -> bool:
        """Wait for the lease -> True once held; False when its holder has kept it longer
        than `stall_timeout_s` (or still does, since an earlier wait gave up)."""
        with self._mu:
            assert self._phase is not _Phase.HELD, "the lease is held already (turns do not nest)"
            if self._phase is _Phase.CLOSED:
                raise RuntimeError("the CPU lease is closed")
            if self._phase is _Phase.ABANDONED:
                return False  # the stuck holder has not let go yet
            if self._try_lock():
                return self._take()
            self._phase = _Phase.WAITING
        self._state[self._flag] = 1
        requested = False
        try:
            self._granted.clear()
            if self._waiter is None:
                waiter = threading.Thread(target=self._wait_loop, name="cpu-lease", daemon=True)
                waiter.start()
                self._waiter = waiter
            requested = True  # (before the thread may start its flock)
            self._request.set()
            why = self._await_grant()
        except BaseException:  # interrupted: no flag left up, no grant kept
            with self._mu:
                self._state[self._flag] = 0
                if self._phase is _Phase.HELD:
                    self._unlock()
                elif self._phase is _Phase.WAITING:
                    self._phase = _Phase.ABANDONED if requested else _Phase.IDLE
            raise
        with self._mu:
            self._state[self._flag] = 0
            if self._phase is _Phase.WAITING:  # (the thread is still in flock)
                self._phase = _Phase.ABANDONED
                log.warning(
                    "the CPU lease %s %s: computing without it until it comes free",
                    self._base,
                    why,
                )
                return False
            return self._take()

    def _try_lock(self) -> bool:
        """The lock now, or False. Through the gate: while an exclusive worker waits for
        shared holders to finish it holds the gate, so that no new shared turn starts."""
        try:
            fcntl.flock(self._gate_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            fcntl.flock(self._lock_fd, self._mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        else:
            return True
        finally:
            fcntl.flock(self._gate_fd, fcntl.LOCK_UN)

    def _await_grant(self) -> str:
        """Wait for the waiting thread's grant, at most the stall timeout and only until a
        worker holding the gate or the lock has been seen stopped at two looks in a row ->
        why it gave up ("" when granted)."""
        deadline = time.monotonic() + self.stall_timeout_s
        suspect = 0
        while True:
            left = deadline - time.monotonic()
            if self._granted.wait(max(0.0, min(STOPPED_CHECK_S, left))):
                return ""
            if left <= STOPPED_CHECK_S:
                return f"has been held for over {self.stall_timeout_s:.3g} s"
            stopped = self._stopped_holder()
            if stopped and stopped == suspect:
                return f"is held by a stopped process (pid {stopped})"
            suspect = stopped

    def _stopped_holder(self) -> int:
        """The pid of another process that holds the gate or the lock and is stopped, or 0."""
        me = os.getpid()
        return next((pid for pid in self.holders() if pid != me and _stopped(pid)), 0)

    def _take(self) -> bool:
        self._phase = _Phase.HELD
        count = int.from_bytes(self._state[self._turn], "little")
        self._state[self._turn] = (count + 1).to_bytes(8, "little")
        return True

    def _unlock(self) -> None:
        self._phase = _Phase.IDLE
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def holders(self) -> list[int]:
        """The pids of the processes holding the gate or the lock now (the kernel's record:
        none without /proc/locks)."""
        return flock_holders([f"{self._base}.gate", f"{self._base}.lock"])

    def _wait_loop(self) -> None:
        while True:
            self._request.wait()
            self._request.clear()
            with self._mu:
                if self._phase is _Phase.CLOSED:
                    return
            # the GIL is released while it waits; the gate is held while waiting for the lock
            fcntl.flock(self._gate_fd, fcntl.LOCK_EX)
            fcntl.flock(self._lock_fd, self._mode)
            fcntl.flock(self._gate_fd, fcntl.LOCK_UN)
            with self._mu:
                if self._phase is _Phase.WAITING:
                    self._phase = _Phase.HELD
                    self._granted.set()
                elif self._phase is _Phase.CLOSED:  # close() left these files to us
                    self._close_files()
                    return
                else:  # abandoned: its caller went on without it
                    self._unlock()

    def release(self) -> None:
        """Unlock; if another worker is waiting, return only once it has taken its turn
        (or HANDOFF_TIMEOUT_S passed), so that this one cannot take the lock straight back.
        (A worker that starts waiting just after this looks gets the turn after next.)"""
        turn = self.turns()
        with self._mu:
            assert self._phase is _Phase.HELD, "release() of a lease that is not held"
            self._unlock()
        if not self.others_waiting():
            return
        deadline = time.monotonic() + HANDOFF_TIMEOUT_S
        while self.turns() == turn:
            if time.monotonic() >= deadline:
                self._clear_stale_flags()
                return
            time.sleep(_POLL_S)

    def others_waiting(self) -> bool:
        return any(self._state[_FLAGS : self._flag]) or any(
            self._state[self._flag + 1 : _FLAGS + SLOTS]
        )

    def _clear_stale_flags(self) -> None:
        """A flag whose slot no live worker holds (its worker died waiting) is cleared."""
        for i in range(SLOTS):
            if i != self.slot and self._state[_FLAGS + i] and not self._slot_alive(i):
                self._state[_FLAGS + i] = 0

    def _slot_alive(self, i: int) -> bool:
        """Whether a live worker holds slot i (its lock on the slot's file)."""
        return is_locked(f"{self._base}.slot{i}")

    def close(self) -> None:
        """Leave the lease (a turn still held is given up; a second close does nothing).
        Call it from the thread that takes the turns, once it takes no more."""
        with self._mu:
            phase, self._phase = self._phase, _Phase.CLOSED
            if phase is _Phase.CLOSED:
                return
            if phase is _Phase.ABANDONED:  # the thread is in flock() on these files
                return  # and closes them once it gets the lock (or the process exits)
            if phase is _Phase.HELD:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            self._close_files()
        self._request.set()  # the thread, if any, returns

    def _close_files(self) -> None:
        self._state[self._flag] = 0
        self._state.close()
        for fd in (self._slot_fd, self._gate_fd, self._lock_fd):
            os.close(fd)

    def turns(self) -> int:
        """Turns taken so far by every worker of the lease."""
        return sum(_PER_SLOT.unpack_from(self._state, _TURNS))


def open_lease(path: str | None, device_type: str, shared: bool = False) -> CpuLease | None:
    """The lease at `path` for a worker computing on `device_type`, or None without one (a
    worker that has its cores to itself). ValueError off the CPU: a GPU worker's forward
    passes must not wait for each other's."""
    if not path:
        return None
    if device_type != "cpu":
        raise ValueError(f"cpu_lease: a {device_type} worker does not share CPUs in turns")
    return CpuLease.open(path, shared=shared)


def slot_turns(path: str | os.PathLike) -> tuple[int, ...]:
    """The turns each slot's worker has taken at the lease at `path`, read from outside it
    (without joining it)."""
    with open(f"{path}.state", "rb") as f:
        return _PER_SLOT.unpack_from(f.read(), _TURNS)


def turn_of(lease: CpuLease | None) -> AbstractContextManager:
    """A turn of `lease`; nothing to wait for without one."""
    return lease.turn() if lease is not None else nullcontext()


def is_locked(path: str) -> bool:
    """Whether someone holds a flock on the file at `path` (False when there is none). A
    worker holds its slot's file locked as long as it lives, in any pid namespace."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (lets go of the lock if it was taken)
    return False


def flock_holders(paths: list[str], locks: str = "/proc/locks") -> list[int]:
    """The pids holding a flock() on any of the files at `paths`, from /proc/locks (its
    lines for queued requests, "->", are not holders; a holder outside our pid namespace
    is not listed, or listed as 0, and left out) -> [] where there is no /proc/locks.

    A line names its file as the kernel's device:inode, the device of the file system's
    superblock. That is stat()'s st_dev on tmpfs (/dev/shm, where leases live) and ext4,
    not on btrfs subvolumes or some overlayfs upper layers: when no line matches a file's
    device:inode, its inode alone is matched (another file system's file of the same
    inode number, flock()ed by a stopped process, would then be taken for a holder)."""
    keys, inodes = set(), set()
    for path in paths:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        keys.add(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}")
        inodes.add(str(st.st_ino))
    try:
        with open(locks) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    held = []  # (pid, device:inode) of every flock() held, not queued
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 1234 00:1b:20700 0 EOF"
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK":
            held.append((int(fields[4]), fields[5]))
    ours = [pid for pid, key in held if key in keys]
    if not ours:
        ours = [pid for pid, key in held if key.rsplit(":", 1)[-1] in inodes]
    return list(dict.fromkeys(pid for pid in ours if pid > 0))


def _stopped(pid: int) -> bool:
    """Whether `pid` is a stopped (or traced) process; False when it is not there or the
    system has no /proc."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]  # after "(comm) "
    return state in (b"T", b"t")


def _field(offset: int, slot: int) -> slice:
    """Slot `slot`'s 8 bytes in the per-slot array at `offset` of the state file."""
    return slice(offset + 8 * slot, offset + 8 * slot + 8)


def _claim_slot(base: str) -> tuple[int, int]:
    for i in range(SLOTS):
        fd = _open(f"{base}.slot{i}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return i, fd
    raise LeaseUnavailable(f"all {SLOTS} slots of the CPU lease at {base} are held")


def _open(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
