"""Processes that die with their parent, however the parent dies, and stop on a signal.

The parent starts the child with `child_env(env, os.getpid())` in its environment; the
child calls `adopt()` first thing: it asks the kernel for SIGTERM when that parent dies
(PR_SET_PDEATHSIG), then checks that the parent is still the one it was started by (had it
died before the call, nobody would signal us: the child exits). The launcher's children and
the tensor-parallel ranks a role starts are made this way.

The request is made by the child, after exec, not by a `preexec_fn` in the parent: a
`preexec_fn` makes Python fork() the whole multi-threaded parent (gRPC, NIXL and torch
threads) and run its at-fork handlers, and gRPC's restarted its poller in the child, which
then died with SIGABRT before exec ("epoll_wait error: Bad file descriptor"; grpc/grpc PR
#43157 describes the same crash). Without one, Python starts the child with vfork and no
handlers run. Linux only: elsewhere adopt() does nothing and the parent's close() still
stops its children.

`StopSignal` is how a role's main thread waits for SIGINT/SIGTERM: its handler sets a flag,
nothing that takes a lock, and the main thread polls a pipe that CPython's C-level
handler writes to (`signal.set_wakeup_fd`). Python runs a signal handler in the
main thread between two bytecodes, possibly while that thread holds a lock: the handler we
had, `threading.Event.set()`, deadlocked on the Event's own lock when a second SIGTERM came
while the first one's set() held it (a router whose launcher was SIGKILLed, stuck three
handlers deep, py-spy showed; a decode worker outlived its launcher in CI the same way).
Several SIGTERMs at once is what a parent's death sends: the kernel sends the parent-death
signal when the parent *thread* exits and moves the child to another live thread of the
parent, so a SIGKILLed launcher with k threads signals up to k times, as they exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import select
import signal
import sys
import time
from collections.abc import Mapping

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_ENV = "PDSERVE_DIE_WITH"  # the pid of the process the child must not outlive


def child_env(env: Mapping[str, str], parent: int) -> dict[str, str]:
    """`env` for a child that must die with `parent` (it calls adopt())."""
    return {**env, PARENT_ENV: str(parent)}


def adopt() -> None:
    """In a child started with child_env(): get SIGTERM when the parent dies, however it
    dies (a SIGKILL leaves it no chance to run close()); exit at once if it is gone already.
    The variable is taken out of our environment: our own children get their own."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before the call: nobody would signal us
        os._exit(1)


_POLL_MAX_MS = 2**31 - 1  # poll() refuses longer timeouts (a longer wait polls again)


class StopSignal:
    """SIGINT or SIGTERM asks this process to stop; `wait()` in the main thread until one
    does. Make it in the main thread (signal handlers can be set nowhere else).

    The kernel may give a process's signal to any of its threads (gRPC's, say), and then
    the main thread's poll is not interrupted: CPython's own C handler, in whichever
    thread got it, writes the signal's number to the pipe (`signal.set_wakeup_fd`), and
    the Python handler runs in the main thread once the poll returns."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self._read, self._write = os.pipe()  # not inherited by children (PEP 446)
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self.requested = False
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals}
        self._poll = select.poll()  # not select(): it refuses descriptors past 1024
        self._poll.register(self._read, select.POLLIN)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until a stop is asked for, or `timeout_s` passed -> whether one was. A byte in
        the pipe (or a signal interrupting it) ends a poll; the handler, due by then, runs
        at the loop's next check."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.requested:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            if self._poll.poll(None if left is None else math.ceil(min(_POLL_MAX_MS, left * 1000))):
                with contextlib.suppress(BlockingIOError):
                    os.read(self._read, 4096)
        return self.requested

    def close(self) -> None:
        """The handlers and the wakeup fd as they were before; the pipe closed."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)
