"""Rank 0's hold on the other ranks of a tensor-parallel group: their processes, one pipe
to each, and the failure of any of them.

The role process is rank 0: it runs the engine core (scheduler, allocator, admission) and
its own shard of the model. It starts ranks 1..size-1 itself (no torchrun), as child
processes (`python -m pdserve.engine.tp_rank`, not multiprocessing's spawn: that would
re-run the user's main script) that die with it, and drives them with plain messages over
a socket pair each, in order:

    send(op, *args)    every other rank runs it; no answer (a step, a block copy)
    send_each(op, a)   the same, each rank its own arguments (a step with per-rank work)
    call(op, *args)    every other rank runs it and answers; -> their answers, rank order
    collect(op)        the answers to an op sent earlier (rank 0 worked meanwhile)

Sends and calls are serialised (a lock), so any thread may use the group. Messages are
plain data (lists, numbers, bytes, dataclasses, numpy arrays): never torch tensors, which
pickle as shared-memory handles only multiprocessing's own children can open.

Collectives inside a step (all-reduce, the logits gather) go over torch.distributed's own
process group (pdserve/parallel/comm.py); the pipes only carry what to do next, so an idle
group waits in a blocking read (no polling, no collective with a timeout to outlive).

A rank that dies, or does not answer a call within the deadline, fails the whole group:
`RankFailed` (not retryable on this group) from the next send/call/collective, and the
`on_failure` callbacks run once, from the watcher thread, the moment a process exits.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection as mpc
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.lifetime import child_env
from pdserve.parallel.comm import RankFailed, TPComm, first_rank, make_store

log = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"  # every rank runs on this node
START_TIMEOUT_S = 600.0  # to join the group and load a shard of the weights
STOP_TIMEOUT_S = 10.0
# Any other answer (a park of a large request to disk) and each collective inside a step
# (a frozen rank) wait EngineArgs.tp_timeout_s.


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to build its shard: plain, picklable data."""

    model: str
    args: object  # EngineArgs
    rank: int
    size: int
    store_port: int
    device: str
    threads: int


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:(base + r) on CUDA, the CPU otherwise."""
    if device.type != "cuda":
        return device
    base = device.index or 0
    return torch.device("cuda", base + rank)


class TPGroup:
    def __init__(
        self,
        model: str,
        args,
        device: torch.device,
        threads: int,
        timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.size = args.tensor_parallel_size
        self.timeout_s = args.tp_timeout_s
        self.failure: RankFailed | None = None
        self._callbacks: list[Callable[[RankFailed], None]] = []
        self._closing = False
        self._lock = threading.Lock()  # the failure
        # the pipes: one message (and a call's answers) at a time, whichever thread sends
        # (a decode worker's step loop and its Start handlers both reach the ranks)
        self._io = threading.RLock()
        self._owed: str | None = None  # an op sent whose answers are not collected yet
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + self.size:
            raise ValueError(
                f"tensor_parallel_size: {self.size} ranks need as many GPUs from {device}, "
                f"this node has {torch.cuda.device_count()}"
            )
        store = make_store(STORE_HOST, self.size, timeout_s)
        self.procs: list[subprocess.Popen] = []
        self.conns: list[mpc.Connection] = []
        try:
            for rank in range(1, self.size):
                spec = RankSpec(
                    model,
                    args,
                    rank,
                    self.size,
                    store.port,
                    str(rank_device(device, rank)),
                    threads,
                )
                self._start(spec)
            self._store = store  # kept alive: the ranks' store connections end at its close
            self.comm: TPComm = self._join(store, device, timeout_s)
        except BaseException:
            self._kill()
            raise
        for rank, proc in enumerate(self.procs, 1):
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"tp-watch-{rank}", daemon=True
            ).start()

    def _start(self, spec: RankSpec) -> None:
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # where `pdserve` imports from
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve.engine.tp_rank", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=child_env(env, os.getpid()),  # a killed rank 0 takes its ranks along
                stdin=subprocess.DEVNULL,
                # out of rank 0's process group: a signal to the group (Ctrl-C, a launcher
                # stopping its children) reaches rank 0, which stops its ranks in order
                start_new_session=True,
            )
        finally:
            theirs.close()
        conn = mpc.Connection(ours.detach())
        self.procs.append(proc)
        self.conns.append(conn)
        conn.send(spec)

    def _join(self, store, device: torch.device, timeout_s: float) -> TPComm:
        """Rank 0's side of the group's rendezvous, given up at once if a rank exits first
        (a rank that cannot start reports why over its pipe)."""
        result: list = []

        def join() -> None:
            try:
                result.append(first_rank(store, self.size, device, timeout_s, self.timeout_s))
            except Exception as e:  # noqa: BLE001 (handed to the waiting thread)
                result.append(e)

        thread = threading.Thread(target=join, name="tp-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(0.1)
            dead = [r for r, p in enumerate(self.procs, 1) if p.poll() is not None]
            if dead:
                why = self._last_words(dead[0])
                raise RankFailed(f"tensor-parallel rank {dead[0]} could not start: {why}")
            if time.monotonic() > deadline:
                raise RankFailed(f"tensor-parallel group of {self.size}: no rendezvous in time")
        if isinstance(result[0], Exception):
            raise RankFailed(f"tensor-parallel group of {self.size}: {result[0]}") from result[0]
        return result[0]

    def _last_words(self, rank: int) -> str:
        conn = self.conns[rank - 1]
        try:
            if conn.poll(0):
                return str(conn.recv()[1])
        except (OSError, EOFError):
            pass
        return f"exited with code {self.procs[rank - 1].returncode}"

    # -- driving the ranks ----------------------------------------------------------------
    def send(self, op: str, *args) -> None:
        self.send_each(op, [args] * len(self.conns))

    def send_each(self, op: str, args: list[tuple], answered: bool = False) -> None:
        """`op` with its own arguments for each other rank (args[0] for rank 1, ...);
        `answered`: the ranks will answer it, and collect(op) must read their answers
        before any other call."""
        with self._io:
            self._check()
            if self._owed is not None:
                raise RuntimeError(f"the answers to {self._owed!r} were never collected")
            for rank, (conn, own) in enumerate(zip(self.conns, args, strict=True), 1):
                try:
                    conn.send((op, own))
                except (OSError, EOFError) as e:
                    raise self._fail(f"rank {rank} is gone ({e})") from e
            if answered:
                self._owed = op

    def call(self, op: str, *args, timeout_s: float | None = None) -> list:
        """Run `op` on every other rank -> their answers in rank order (1, 2, ...)."""
        with self._io:
            self.send_each(op, [args] * len(self.conns), answered=True)
            return self.collect(op, timeout_s)

    def collect(self, op: str, timeout_s: float | None = None) -> list:
        """The answers to an `op` sent earlier (rank 0 did its own share meanwhile)."""
        with self._io:
            if self._owed != op:
                raise RuntimeError(f"no answers to {op!r} are owed (owed: {self._owed!r})")
            self._owed = None  # read now, or lost with a failed group
            self._check()
            deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
            return [self._answer(r, conn, op, deadline) for r, conn in enumerate(self.conns, 1)]

    def _answer(self, rank: int, conn: mpc.Connection, op: str, deadline: float):
        try:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise self._fail(f"rank {rank} did not answer {op!r} in time")
            status, value = conn.recv()
        except (OSError, EOFError) as e:
            raise self._fail(f"rank {rank} exited during {op!r}") from e
        if status != "ok":
            raise self._fail(f"rank {rank} failed in {op!r}: {value}")
        return value

    def on_failure(self, callback: Callable[[RankFailed], None]) -> None:
        """`callback(error)` once, when a rank dies or fails (a worker takes itself out of
        service: the router then stops routing to it)."""
        self._callbacks.append(callback)

    def fail(self, why: str) -> RankFailed:
        """Mark the group failed (a collective of a step failed) -> the error to raise;
        the on_failure callbacks run, once."""
        return self._fail(why)

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _fail(self, why: str) -> RankFailed:
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = RankFailed(f"tensor-parallel group of {self.size}: {why}")
            error = self.failure
        if first and not self._closing:
            log.error("%s", error)
            for callback in self._callbacks:
                try:
                    callback(error)
                except Exception:  # a failing callback must not hide the failure
                    log.exception("tensor-parallel failure callback raised")
        return error

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing:
            self._fail(f"rank {rank} exited (code {code})")

    # -- stopping -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every other rank (their tiers closed first), waiting at most STOP_TIMEOUT_S."""
        if self._closing:
            return
        self._closing = True  # from here on a rank's exit is expected
        if self.failure is None:
            # a rank gone already, or a step's answers never read: killed below anyway
            with contextlib.suppress(RankFailed, RuntimeError):
                self.call("close", timeout_s=STOP_TIMEOUT_S)
        self._kill()

    def _kill(self) -> None:
        self._closing = True
        for conn in self.conns:
            conn.close()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_TIMEOUT_S)
