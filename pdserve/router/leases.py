"""Keeping reservations alive while their prefill runs, so that leases can be short.

A reservation's lease (RouterConfig.lease_s, seconds) ends it on the decode worker unless
Start or a renewal comes first. The router renews every reservation it holds every third of
a lease, from one thread, until the request starts or ends: a router that dies stops
renewing, and its reservations give their blocks back within one lease (they used to be held
for the whole prefill timeout plus a minute). A renewal that finds the reservation gone, or
a worker that does not answer, changes nothing here: the Start that follows fails and the
request is tried again (pdserve/router/handoff.py). The renewals of one round go out at
once and are waited for together, and workers that have stopped answering are skipped, so
one frozen worker cannot make the round outlast the leases of the others.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pdserve.router.periodic import Periodic
from pdserve.router.registry import Worker
from pdserve.rpc import pdserve_pb2 as pb


@dataclass(eq=False)
class Lease:
    worker: Worker
    request_id: str  # the decode worker's id of the reservation
    fence: int


class LeaseKeeper:
    def __init__(
        self, lease_s: float, skip: Callable[[Worker], bool] = lambda worker: False
    ) -> None:
        self.lease_s = lease_s
        self.skip = skip  # workers not worth asking (suspect or silent)
        self.period_s = lease_s / 3
        self._held: set[Lease] = set()
        self._lock = threading.Lock()
        self._ticker = Periodic("router-leases", self.period_s, self.renew_all)

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

    def renew_all(self) -> int:
        """One round -> how many renewals were sent."""
        with self._lock:
            held = [lease for lease in self._held if lease.worker.stub is not None]
        calls = []
        for lease in held:
            if self.skip(lease.worker):
                continue
            request = pb.RenewRequest(
                request_id=lease.request_id, fence=lease.fence, lease_s=self.lease_s
            )
            # a channel the registry closed raises ValueError
            with contextlib.suppress(grpc.RpcError, ValueError):
                calls.append(lease.worker.stub.Renew.future(request, timeout=self.period_s))
        for call in calls:  # each has its own deadline: this waits one period at most
            with contextlib.suppress(grpc.RpcError, grpc.FutureCancelledError):
                call.result()
        return len(calls)

    def close(self) -> None:
        self._ticker.close()
