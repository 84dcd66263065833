"""Keeping reservations alive while their prefill runs, so that leases can be short.

A reservation's lease (RouterConfig.lease_s, seconds) ends it on the decode worker unless
Start or a renewal comes first. The router renews every reservation it holds every third of
a lease, from one thread, until the request starts or ends: a router that dies stops
renewing, and its reservations give their blocks back within one lease (they used to be held
for the whole prefill timeout plus a minute). A renewal that finds the reservation gone, or
a worker that does not answer, changes nothing here: the Start that follows fails and the
request is tried again (pdserve/router/handoff.py).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import grpc

from pdserve.router.registry import Worker
from pdserve.rpc import pdserve_pb2 as pb


@dataclass(eq=False)
class Lease:
    worker: Worker
    request_id: str  # the decode worker's id of the reservation
    fence: int


class LeaseKeeper:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.period_s = lease_s / 3
        self._held: set[Lease] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-leases", daemon=True)
        self._thread.start()

    def hold(self, worker: Worker, request_id: str, fence: int) -> Lease:
        lease = Lease(worker, request_id, fence)
        with self._lock:
            self._held.add(lease)
        return lease

    def drop(self, lease: Lease) -> None:
        with self._lock:
            self._held.discard(lease)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def renew_all(self) -> None:
        with self._lock:
            held = list(self._held)
        for lease in held:
            if lease.worker.stub is None:
                continue
            with contextlib.suppress(grpc.RpcError):
                lease.worker.stub.Renew(
                    pb.RenewRequest(
                        request_id=lease.request_id, fence=lease.fence, lease_s=self.lease_s
                    ),
                    timeout=self.period_s,
                )

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.renew_all()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period_s + 1)
