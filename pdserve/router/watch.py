"""Watching the decode streams the router relays: a stream whose worker stopped heartbeating
is cancelled, so the request can be resumed elsewhere (pdserve/router/handoff.py).

A worker that dies closes its connections and its streams fail at once; one that freezes
(SIGSTOP, a hung process, a partition) keeps the connection open and its streams would wait
for the stream deadline (an hour). Every heartbeat interval this thread looks at the streams
it watches; one whose worker has been silent for `alive_window_s` (the same window after
which the registry stops routing to it) is cancelled and marked lost.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc

from pdserve.router.periodic import Periodic
from pdserve.router.registry import Worker, WorkerRegistry


@dataclass(eq=False)
class Watched:
    worker: Worker
    call: grpc.Future  # a Start stream or a Prefill future: cancel() ends it
    lost: bool = False  # cancelled here: its worker went silent


class StreamWatch:
    def __init__(self, registry: WorkerRegistry, period_s: float) -> None:
        self.registry = registry
        self.period_s = period_s
        self._watched: set[Watched] = set()
        self._lock = threading.Lock()
        self._ticker = Periodic("router-watch", period_s, self.check)

    def add(self, worker: Worker, call) -> Watched:
        watched = Watched(worker, call)
        with self._lock:
            self._watched.add(watched)
        return watched

    def remove(self, watched: Watched) -> None:
        with self._lock:
            self._watched.discard(watched)

    def check(self) -> int:
        """Cancel the streams of silent workers -> how many."""
        with self._lock:
            lost = [w for w in self._watched if not w.lost and self.registry.silent(w.worker)]
            for w in lost:
                w.lost = True
        for w in lost:
            w.call.cancel()
        return len(lost)

    def close(self) -> None:
        self._ticker.close()
