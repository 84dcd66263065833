"""The workers a router knows, and the choice among them.

Workers register and repeat the registration as their heartbeat, with fresh stats. A worker
that misses `missed_heartbeats` heartbeats (dead, or just slow under load) gets no new
requests, but its channel stays open for the streams it is serving; only a long silence
removes it. A worker that fails to answer a call in time (frozen by SIGSTOP, or gone) is
suspect at once: no new requests until its next heartbeat.

Choice: decode workers by projected headroom (the worker's own projection of free blocks
after expected growth: its admission policy's unit), prefill workers by queued prompt
tokens. Between two heartbeats the router subtracts what it has itself sent since the last
one: for a decode worker the headroom each reservation took (its ReserveResponse says how
much, in the same unit), for a prefill worker the prompt tokens. A Reserve still in flight
counts too: among workers with equal room, the one with fewer reservations on their way
goes first, so a burst of requests spreads instead of all picking the same worker before
any answer is back. Every read and change of those counts happens under the registry's
lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pdserve.router.config import RouterConfig
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving import auth
from pdserve.serving.auth import Security
from pdserve.serving.registration import WorkerStats
from pdserve.serving.server import MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class WorkerRecord:
    """A worker as its last heartbeat described it."""

    worker_id: str
    role: str  # "prefill" | "decode"
    address: str
    metrics_address: str
    stats: WorkerStats


def grpc_connect(
    record: WorkerRecord, security: Security | None = None
) -> tuple[grpc.Channel, rpc.DecodeStub | rpc.PrefillStub]:
    """A channel to the worker (presenting the cluster secret) and the stub of its role. It
    takes messages as large as the workers' servers do: a request's final message carries
    its trace, a span a decode step (~60 bytes), past gRPC's default 4 MiB at ~70k tokens,
    and on a feed one message too large would end the feed of every request on it."""
    channel = auth.channel(
        record.address, security, [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    )
    return channel, (rpc.DecodeStub if record.role == "decode" else rpc.PrefillStub)(channel)


@dataclass
class Worker:
    record: WorkerRecord
    last_seen: float  # on the registry's clock
    channel: grpc.Channel | None
    stub: rpc.DecodeStub | rpc.PrefillStub | None
    pending_blocks: int = 0  # headroom this router's reservations took since the heartbeat
    # it did not answer a call in time (frozen, or its process gone): no new requests until
    # its next heartbeat says it is back
    suspect: bool = False
    pending_tokens: int = 0  # prompt tokens this router sent since the heartbeat
    reserving: int = 0  # Reserve calls of this router on their way to it now

    @property
    def worker_id(self) -> str:
        return self.record.worker_id


@dataclass
class WorkerRegistry:
    config: RouterConfig
    # injected so that the simulator runs this very registry on its virtual clock, with no
    # channels (pdserve/sim)
    clock: Callable[[], float] = time.monotonic
    connect: Callable[[WorkerRecord], tuple] = grpc_connect
    on_forget: Callable[[str], None] | None = None  # a worker id that left the registry
    _workers: dict[str, Worker] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # decode workers being drained (pdserve/router/migrate.py): no new requests while
    # another decode worker can take them; a worker that registers again at another
    # address (restarted) is routable again
    _draining: set[str] = field(default_factory=set)

    def knows(self, record: WorkerRecord) -> bool:
        """Whether this worker is registered at this address already (a heartbeat)."""
        with self._lock:
            known = self._workers.get(record.worker_id)
            return known is not None and known.record.address == record.address

    def upsert(self, record: WorkerRecord) -> None:
        """A registration or heartbeat: fresh stats replace what this router counted."""
        with self._lock:
            known = self._workers.get(record.worker_id)
            if known is None or known.record.address != record.address:
                if known is not None:
                    self._close(known)
                self._draining.discard(record.worker_id)
                channel, stub = self.connect(record)
                self._workers[record.worker_id] = Worker(record, self.clock(), channel, stub)
            else:
                known.record, known.last_seen = record, self.clock()
                known.suspect = False
                known.pending_blocks = known.pending_tokens = 0

    @staticmethod
    def _close(worker: Worker) -> None:
        if worker.channel is not None:
            worker.channel.close()

    def alive(self, role: str) -> list[Worker]:
        """Workers of `role` heard from recently (and forget the long silent)."""
        now = self.clock()
        with self._lock:
            silent = [
                wid
                for wid, w in self._workers.items()
                if now - w.last_seen > self.config.forget_after_s
            ]
            for wid in silent:
                self._close(self._workers.pop(wid))
                self._draining.discard(wid)  # gone: nothing left to drain
                if self.on_forget is not None:
                    self.on_forget(wid)
            cutoff = now - self.config.alive_window_s
            return [
                w for w in self._workers.values() if w.record.role == role and w.last_seen >= cutoff
            ]

    def silent(self, worker: Worker) -> bool:
        """Whether `worker` has missed its heartbeats (the window after which it gets no
        new requests), or left the registry."""
        with self._lock:
            known = self._workers.get(worker.worker_id)
        if known is not worker:
            return True
        return self.clock() - worker.last_seen > self.config.alive_window_s

    def _routable(self, role: str, draining: bool = False) -> list[Worker]:
        """Alive, not suspect and not draining (`draining`: only the draining ones): the
        ones new requests may go to."""
        with self._lock:
            drained = set(self._draining)
        return [
            w for w in self.alive(role) if not w.suspect and (w.worker_id in drained) == draining
        ]

    def routable(self, role: str) -> list[Worker]:
        """The `role` workers new requests (and migrated ones) may go to now."""
        return self._routable(role)

    def find(self, worker_id: str, role: str) -> Worker | None:
        """The live `role` worker of that id."""
        return next((w for w in self.alive(role) if w.worker_id == worker_id), None)

    def drain(self, worker: Worker, undo: bool = False) -> None:
        """No new requests for `worker` (its own go on, or are moved); `undo`: again."""
        with self._lock:
            if undo:
                self._draining.discard(worker.worker_id)
            else:
                self._draining.add(worker.worker_id)

    def not_ready(self) -> str:
        """Why the cluster cannot serve a request now ("" when it can)."""
        missing = [role for role in ("prefill", "decode") if not self.alive(role)]
        if not missing:
            return ""
        return f"no {' and no '.join(missing)} worker is registered"

    def decode_order(self) -> list[Worker]:
        """Live decode workers, the most projected headroom first."""
        workers = self._routable("decode")
        with self._lock:
            return sorted(workers, key=self._room, reverse=True)

    @staticmethod
    def _room(w: Worker) -> tuple[int, int]:
        return (w.record.stats.headroom_blocks - w.pending_blocks, -w.reserving)

    def pick_decode(self, tried: set[str]) -> Worker | None:
        """The live decode worker with the most room not in `tried`; its Reserve counts as
        on its way until reserved() or not_reserved()."""
        workers = [w for w in self._routable("decode") if w.worker_id not in tried]
        if not workers:  # a draining worker still takes work when no other one can
            workers = [w for w in self._routable("decode", True) if w.worker_id not in tried]
        if not workers:
            return None
        with self._lock:
            best = max(workers, key=self._room)
            best.reserving += 1
        return best

    def suspect(self, worker: Worker) -> None:
        """`worker` did not answer in time: skip it until its next heartbeat."""
        with self._lock:
            worker.suspect = True

    def reserved(self, worker: Worker, headroom_cost_blocks: int) -> None:
        with self._lock:
            worker.reserving -= 1
            worker.pending_blocks += headroom_cost_blocks

    def not_reserved(self, worker: Worker) -> None:
        with self._lock:
            worker.reserving -= 1

    def pick_prefill(self, prompt_tokens: int) -> Worker | None:
        """The live prefill worker with the fewest queued tokens (its last heartbeat plus
        what this router sent since); the prompt counts against it from now on."""
        workers = self._routable("prefill")
        if not workers:
            return None
        with self._lock:
            best = min(workers, key=lambda w: w.record.stats.queued_tokens + w.pending_tokens)
            best.pending_tokens += prompt_tokens
        return best

    def listing(self) -> list[tuple[WorkerRecord, float]]:
        """(record, seconds since its last heartbeat) of every live worker."""
        now = self.clock()
        return [
            (w.record, now - w.last_seen)
            for role in ("prefill", "decode")
            for w in self.alive(role)
        ]
