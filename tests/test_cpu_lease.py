"""The CPU lease (pdserve/serving/cpu_lease.py): one holder at a time, turns handed to a
waiting worker, a dead worker's lock and flag never block the others, nor does a stopped
holder, nor a stuck one for longer than the stall timeout."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pdserve.serving import cpu_lease, lease_dir
from pdserve.serving.cpu_lease import CpuLease, LeaseUnavailable, is_locked, open_lease

DEADLINE_S = 30.0

# a worker: N turns, each creating an exclusive marker (two holders at once cannot both
# create it) and logging its name, with the CPUs "used" for 2 ms
WORKER = """
import os, sys, time
from pdserve.serving.cpu_lease import CpuLease
path, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
lease = CpuLease.open(path)
print("open", flush=True)
sys.stdin.readline()  # go
for _ in range(n):
    with lease.turn():
        fd = os.open(path + ".inside", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        with open(path + ".log", "a") as log:
            log.write(name + "\\n")
        time.sleep(0.002)
        os.close(fd)
        os.unlink(path + ".inside")
"""

# a process that waits for the lease (or holds it) until killed
HOLDER = """
import sys, time
from pdserve.serving.cpu_lease import CpuLease
lease = CpuLease.open(sys.argv[1])
lease.acquire()
print("held", flush=True)
time.sleep(600)
"""


def _start(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=DEADLINE_S)
        for stream in (p.stdin, p.stdout):
            if stream:
                stream.close()


def _flags_up(path: str) -> int:
    with open(path + ".state", "rb") as f:
        return sum(f.read()[cpu_lease._FLAGS :])


def _gate_held(path: str) -> bool:
    fd = os.open(path + ".gate", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _acquire_in_thread(lease: CpuLease) -> threading.Event:
    got = threading.Event()
    threading.Thread(target=lambda: lease.acquire() and got.set(), daemon=True).start()
    return got


def test_workers_hold_it_one_at_a_time_and_take_turns(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_lease, "HANDOFF_TIMEOUT_S", 10.0)  # a slow waiter is still waited for
    path, n = str(tmp_path / "cpu"), 40
    procs = [_start(WORKER, path, name, str(n)) for name in "abc"]
    gate = CpuLease.open(path)  # held until all three wait: none starts ahead of the others
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "open"
        assert gate.acquire()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        _until(lambda: _flags_up(path) == 3, "the three workers to wait")
        gate.release()
        for p in procs:
            assert p.wait(timeout=DEADLINE_S) == 0  # an overlap is a FileExistsError
    finally:
        _stop(*procs)
        gate.close()
    order = (tmp_path / "cpu.log").read_text().split()
    assert sorted(order) == sorted("abc" * n)
    # none starved: when the first worker is done, the others have had most of their turns
    # too (three processes on two CPUs interleave even without the hand-off, so the
    # hand-off itself is checked in order by the next test)
    first_done = min(max(i for i, w in enumerate(order) if w == name) for name in "abc")
    before = order[: first_done + 1]
    assert all(before.count(name) >= n // 2 for name in "abc"), "".join(order)


def test_a_release_hands_the_turn_to_a_waiting_worker(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_lease, "HANDOFF_TIMEOUT_S", 10.0)  # a slow waiter is still waited for
    path = tmp_path / "cpu"
    first, second = CpuLease.open(path), CpuLease.open(path)
    assert first.slot != second.slot
    log = []
    assert first.acquire()
    assert first.turns() == 1

    def wait_for_a_turn():
        with second.turn():
            log.append("second")
            time.sleep(0.01)

    t = threading.Thread(target=wait_for_a_turn)
    t.start()
    try:
        _until(first.others_waiting, "the second worker to wait")
        first.release()  # returns once the waiting worker has the lease
        assert first.acquire()  # so this one is after its turn
        log.append("first")
        assert log == ["second", "first"]
        assert first.turns() == 3
        first.release()
    finally:
        t.join(timeout=DEADLINE_S)
        first.close()
        second.close()
    assert not t.is_alive()


def test_no_waiter_no_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_lease, "HANDOFF_TIMEOUT_S", 1.0)  # a wait per turn: 100 s
    lease = CpuLease.open(tmp_path / "cpu")
    try:
        start = time.monotonic()
        for _ in range(100):
            with lease.turn():
                pass
        assert lease.turns() == 100
        assert time.monotonic() - start < 10
        with lease.turn(), pytest.raises(AssertionError, match="do not nest"):
            lease.acquire()
    finally:
        lease.close()


def test_a_dead_holder_frees_the_lease(tmp_path):
    path = str(tmp_path / "cpu")
    holder = _start(HOLDER, path)
    lease = CpuLease.open(path)
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGKILL)
        got = threading.Event()
        t = threading.Thread(target=lambda: (lease.acquire(), got.set()), daemon=True)
        t.start()
        assert got.wait(DEADLINE_S), "the lease was not freed when its holder died"
        lease.release()
    finally:
        _stop(holder)
        lease.close()


def test_a_worker_that_died_waiting_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_lease, "HANDOFF_TIMEOUT_S", 2.0)
    path = str(tmp_path / "cpu")
    lease = CpuLease.open(path)
    lease.acquire()
    waiter = _start(HOLDER, path)  # blocks in acquire(): its flag is up
    try:
        _until(lease.others_waiting, "the other worker to wait")
        waiter.send_signal(signal.SIGKILL)
        waiter.wait(timeout=DEADLINE_S)
        start = time.monotonic()
        lease.release()  # no one takes the turn: it gives up after the hand-off timeout
        assert 2.0 <= time.monotonic() - start < 2.0 + 5
        assert not lease.others_waiting()  # and the dead worker's flag is cleared
        start = time.monotonic()
        with lease.turn():  # so the next hand-off does not wait for it again
            pass
        assert time.monotonic() - start < 1.0
    finally:
        _stop(waiter)
        lease.close()


def test_slots_run_out_and_come_back(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_lease, "SLOTS", 2)
    path = tmp_path / "cpu"
    a, b = CpuLease.open(path), CpuLease.open(path)
    with pytest.raises(LeaseUnavailable, match="all 2 slots"):
        CpuLease.open(path)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(LeaseUnavailable):
        CpuLease.open(path)
    assert len(os.listdir("/proc/self/fd")) == fds  # a failed open leaks nothing
    a.close()
    c = CpuLease.open(path)
    assert c.slot == a.slot
    b.close()
    c.close()


def test_only_cpu_workers_take_turns(tmp_path):
    assert open_lease(None, "cuda") is None
    with pytest.raises(ValueError, match="cpu_lease: a cuda worker"):
        open_lease(str(tmp_path / "cpu"), "cuda")
    lease = open_lease(str(tmp_path / "cpu"), "cpu")
    assert isinstance(lease, CpuLease)
    lease.close()


def test_a_stuck_holder_is_waited_for_only_so_long(tmp_path, caplog):
    path = str(tmp_path / "cpu")
    holder = _start(HOLDER, path)  # holds the lease and never lets go (a hung worker)
    lease = CpuLease.open(path, stall_timeout_s=1.0)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        assert not lease.acquire()  # gave up: compute without it
        assert 1.0 <= time.monotonic() - start < 1.0 + 5
        assert "computing without it" in caplog.text
        assert _flags_up(path) == 0  # no worker's flag is up: none waits for a turn
        start = time.monotonic()
        with lease.turn():  # still stuck: no second wait
            pass
        assert time.monotonic() - start < 0.5
        holder.send_signal(signal.SIGKILL)  # the lock comes free: turns again
        _until(lambda: lease.acquire(), "the lease to be taken again")
        assert lease.turns() == 2  # the stuck holder's turn, then this one
        lease.release()
    finally:
        _stop(holder)
        lease.close()


def test_a_stopped_holder_is_not_waited_for(tmp_path, caplog):
    path = str(tmp_path / "cpu")
    holder = _start(HOLDER, path)
    lease = CpuLease.open(path)  # the default stall timeout: minutes
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lease.holders() == [holder.pid]
        holder.send_signal(signal.SIGSTOP)  # frozen mid-turn
        start = time.monotonic()
        assert not lease.acquire()  # gave up: compute without it
        assert time.monotonic() - start < 5 * cpu_lease.STOPPED_CHECK_S + 5
        assert f"held by a stopped process (pid {holder.pid})" in caplog.text
        holder.send_signal(signal.SIGCONT)
        holder.send_signal(signal.SIGKILL)  # the lock comes free: turns again
        _until(lambda: lease.acquire(), "the lease to be taken again")
        assert lease.holders() == [os.getpid()]  # the killed one holds nothing
        lease.release()
        assert lease.holders() == []
    finally:
        _stop(holder)
        lease.close()


# a worker stopped the moment its flock() of the gate returns, before its next line (the
# failpoint's SIGSTOP can land there: that thread waits for the GIL the stopping thread
# holds); argv[2]: "free" (the gate got at once, the lease free) or "waiting" (its waiting
# thread's blocking flock, the lease held by another)
STOPPED_AT_THE_GATE = """
import fcntl, os, signal, sys
from pdserve.serving.cpu_lease import CpuLease
path, where = sys.argv[1], sys.argv[2]
lease = CpuLease.open(path)
real = fcntl.flock
def flock(fd, op):
    real(fd, op)
    nonblocking = bool(op & fcntl.LOCK_NB)
    if fd == lease._gate_fd and op & fcntl.LOCK_EX and nonblocking == (where == "free"):
        os.kill(os.getpid(), signal.SIGSTOP)
fcntl.flock = flock
print("open", flush=True)
lease.acquire()
"""


@pytest.mark.parametrize("where", ["free", "waiting"])
def test_a_worker_stopped_as_it_got_the_gate_is_named(tmp_path, caplog, where):
    """Stopped between its flock() and its next line, a worker holds the gate: whoever waits
    behind it must see it (the kernel's record), not wait out the stall timeout. (When the
    workers wrote their pids into the state file, after their flock(), both waited 20 s.)"""
    path = str(tmp_path / "cpu")
    first = CpuLease.open(path)
    second = CpuLease.open(path, stall_timeout_s=20.0)
    worker = None
    try:
        if where == "waiting":
            assert first.acquire()  # held: the other's turn goes through its waiting thread
        worker = _start(STOPPED_AT_THE_GATE, path, where)
        assert worker.stdout.readline().strip() == "open"
        _until(lambda: cpu_lease._stopped(worker.pid), "the worker to stop at the gate")
        assert _gate_held(path)
        if where == "waiting":
            first.release()
        start = time.monotonic()
        assert not second.acquire()  # gave up on the stopped worker: compute without it
        assert time.monotonic() - start < 5 * cpu_lease.STOPPED_CHECK_S + 5
        assert f"held by a stopped process (pid {worker.pid})" in caplog.text
    finally:
        if worker is not None:
            _stop(worker)  # (SIGKILL ends a stopped process too)
        first.close()
        second.close()


def test_a_worker_stopped_while_it_waited_is_no_holder(tmp_path):
    """A holds the lease and runs; B waits for it (holding the gate); C waits behind B and
    is stopped there. C holds nothing (the kernel takes a stopped waiter out of the queue),
    so B goes on waiting for A instead of computing beside it."""
    path = str(tmp_path / "cpu")
    holder = _start(HOLDER, path)  # A: asleep (state S), holding the lease
    lease = CpuLease.open(path)  # B
    stopped = None
    try:
        assert holder.stdout.readline().strip() == "held"
        got = _acquire_in_thread(lease)
        _until(lambda: _flags_up(path) == 1 and _gate_held(path), "B to wait at the lock")
        stopped = _start(HOLDER, path)  # C: its flock() of the gate waits behind B
        _until(lambda: _flags_up(path) == 2, "C to wait")
        stopped.send_signal(signal.SIGSTOP)
        _until(lambda: cpu_lease._stopped(stopped.pid), "C to stop")
        assert sorted(lease.holders()) == sorted([holder.pid, os.getpid()])  # A, B: not C
        assert not got.wait(6 * cpu_lease.STOPPED_CHECK_S)  # several looks: A is not stopped
        assert lease._phase is cpu_lease._Phase.WAITING
        holder.send_signal(signal.SIGKILL)
        assert got.wait(DEADLINE_S), "B did not get its turn"
        lease.release()
    finally:
        for p in (holder, stopped):
            if p is not None:
                _stop(p)
        lease.close()


def test_the_holders_are_read_off_the_kernels_lock_list(tmp_path):
    """/proc/locks as the kernel writes it: held flock()s count, queued ones ("->") do not,
    nor pid 0 (outside our pid namespace); where no line names a file's device:inode (a
    file system whose superblock device is not stat()'s st_dev) its inode alone is matched."""
    path = tmp_path / "cpu.lock"
    path.touch()
    st = os.stat(path)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    locks = tmp_path / "locks"
    locks.write_text(
        f"1: FLOCK  ADVISORY  WRITE 101 {dev}:{st.st_ino} 0 EOF\n"
        f"1: -> FLOCK  ADVISORY  WRITE 102 {dev}:{st.st_ino} 0 EOF\n"
        f"2: FLOCK  ADVISORY  READ 103 {dev}:{st.st_ino} 0 EOF\n"
        f"3: FLOCK  ADVISORY  WRITE 0 {dev}:{st.st_ino} 0 EOF\n"
        f"4: POSIX  ADVISORY  WRITE 104 {dev}:{st.st_ino} 0 EOF\n"
        f"5: FLOCK  ADVISORY  WRITE 105 {dev}:{st.st_ino + 1} 0 EOF\n"
        f"6: FLOCK  ADVISORY  WRITE 101 {dev}:{st.st_ino} 0 EOF\n"
    )
    assert cpu_lease.flock_holders([str(path)], str(locks)) == [101, 103]
    locks.write_text(
        f"1: FLOCK  ADVISORY  WRITE 106 ab:cd:{st.st_ino} 0 EOF\n"
        f"2: -> FLOCK  ADVISORY  WRITE 107 ab:cd:{st.st_ino} 0 EOF\n"
    )
    assert cpu_lease.flock_holders([str(path)], str(locks)) == [106]  # by inode alone
    assert cpu_lease.flock_holders([str(path)], str(tmp_path / "none")) == []
    assert cpu_lease.flock_holders([str(tmp_path / "gone")], str(locks)) == []


def test_a_running_holder_is_waited_for(tmp_path):
    path = str(tmp_path / "cpu")
    holder = _start(HOLDER, path)  # another process, asleep (state S) holding the lease
    lease = CpuLease.open(path)
    try:
        assert holder.stdout.readline().strip() == "held"
        got = _acquire_in_thread(lease)
        # several of the waiter's looks at the holder: not stopped, so it keeps waiting
        assert not got.wait(6 * cpu_lease.STOPPED_CHECK_S)
        assert lease._phase is cpu_lease._Phase.WAITING
        holder.send_signal(signal.SIGKILL)
        assert got.wait(DEADLINE_S), "the waiter did not get its turn"
        lease.release()
    finally:
        _stop(holder)
        lease.close()


def test_shared_turns_overlap_and_an_exclusive_one_is_not_starved(tmp_path):
    path = str(tmp_path / "cpu")
    s1, s2 = CpuLease.open(path, shared=True), CpuLease.open(path, shared=True)
    x = CpuLease.open(path)
    try:
        assert s1.acquire() and s2.acquire()  # side by side, neither waits
        x_got = _acquire_in_thread(x)
        assert not x_got.wait(0.2)  # an exclusive turn waits for every shared one
        s2.release()
        assert not x_got.wait(0.2)
        _until(lambda: _gate_held(path), "the exclusive worker to hold the gate")
        s2_got = _acquire_in_thread(s2)  # a shared turn asked for while x waits...
        assert not s2_got.wait(0.2)  # ...waits behind x, though s1's turn is shared
        s1.release()
        assert x_got.wait(DEADLINE_S), "the exclusive worker did not get its turn"
        assert not s2_got.wait(0.2)  # x holds it alone
        x.release()
        assert s2_got.wait(DEADLINE_S), "the shared worker did not get its turn after x"
        s2.release()
    finally:
        for lease in (s1, s2, x):
            lease.close()


def test_an_interrupted_wait_leaves_no_flag_up_and_close_is_final(tmp_path):
    path = str(tmp_path / "cpu")
    holder = CpuLease.open(path)
    lease = CpuLease.open(path)
    try:
        assert holder.acquire()

        class Interrupted(Exception):
            pass

        def interrupt(timeout=None):
            raise Interrupted  # as a Ctrl-C in the wait would

        lease._granted.wait = interrupt
        with pytest.raises(Interrupted):
            lease.acquire()
        assert _flags_up(path) == 0  # a holder's hand-off does not wait on a flag left up
        del lease._granted.wait
        holder.release()
        # the interrupted request's grant is let go, not kept: the lease comes free for both
        assert holder.acquire()
        holder.release()
        _until(lambda: lease._phase is cpu_lease._Phase.IDLE, "the grant to be let go")
        assert lease.acquire()
        lease.release()
    finally:
        holder.close()
        lease.close()
        lease.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        lease.acquire()


def test_a_killed_launchers_lease_directory_goes_at_the_next_launch(tmp_path):
    """A lease directory is named for its launcher's pid; the next launch removes those that
    nobody uses (their launcher was SIGKILLed: its close() never ran) and leaves alone any
    whose launcher runs, any with a locked file (a launcher or worker in another pid
    namespace sharing /dev/shm), any too young to judge and anything else."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    old = lease_dir.ORPHAN_AGE_S + 10

    def lease(name: str, age_s: float = old):
        d = tmp_path / f"{lease_dir.PREFIX}{name}"
        d.mkdir()
        (d / "cpu.slot0").write_bytes(b"")
        os.utime(d, (os.path.getmtime(d) - age_s,) * 2)
        return d

    stale = lease(f"{gone.pid}-abc")
    held = lease(f"{gone.pid}-def")
    kept = [
        held,
        lease(f"{gone.pid}-ghi", age_s=0),  # just made
        lease(f"{os.getpid()}-jkl"),  # its launcher is alive
        lease("1-mno"),  # alive (init), whoever's it is
        lease("xyz"),  # no pid in its name
        tmp_path / "something-else",
    ]
    kept[-1].mkdir()
    with open(held / "cpu.slot0") as slot:
        fcntl.flock(slot, fcntl.LOCK_SH)  # a worker we cannot see by its pid
        made, owner = lease_dir.make_lease_dir(shm=str(tmp_path))
    assert not stale.exists() and all(d.exists() for d in kept)
    assert os.path.dirname(made) == str(tmp_path)
    assert os.path.basename(made).startswith(f"{lease_dir.PREFIX}{os.getpid()}-")
    owner_file = os.path.join(made, lease_dir.OWNER)
    assert is_locked(owner_file)  # until the launcher lets go
    owner.close()
    assert not is_locked(owner_file) and not is_locked(str(held / "cpu.slot0"))
    assert not is_locked(str(tmp_path / "no-such-file"))
