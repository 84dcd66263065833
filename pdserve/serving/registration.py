"""A worker's registration with the router, repeated as its heartbeat with fresh stats."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving import auth
from pdserve.serving.auth import Security
from pdserve.serving.convert import worker_info

# The heartbeat interval until the router says otherwise (RegisterResponse); the router's
# own default (pdserve/router/config.py) is this value.
HEARTBEAT_S = 1.0
MAX_PARKED_IDS = 32  # parked request ids a decode worker's heartbeat carries at most
REGISTER_TIMEOUT_S = 2.0
# answers no later heartbeat can change by itself: said once in the log, then retried quietly
# (an operator may fix the router's secret or version and restart it)
_REFUSED = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerStats:
    """What a heartbeat tells the router (the counts may be a moment stale)."""

    free_blocks: int
    total_blocks: int
    running: int = 0  # decode: requests in the running batch
    queued_tokens: int = 0  # prefill: prompt tokens waiting
    # decode: blocks a new request could still count on (the admission policy's projection)
    headroom_blocks: int = 0
    preempted: int = 0  # decode: waiting for room after a preemption (parked or to recompute)
    parked: tuple[str, ...] = ()  # decode: ids of parked requests, longest parked first
    # decode: blocks left once every held request grew by its expected output (any policy;
    # negative: projected to preempt). None: not reported (a prefill worker, an old decode)
    projected_free_blocks: int | None = None


def stop_this_process() -> None:
    """SIGTERM to ourselves: the worker's own shutdown runs (leases, tiers, transfer agent)."""
    os.kill(os.getpid(), signal.SIGTERM)


class Registration:
    """`on_failure` runs if the heartbeat thread itself fails (a bug, not a router that is
    away): a worker the router no longer hears from must not linger, half alive, holding
    memory and requests; by default it stops, and a supervisor may start it again."""

    def __init__(
        self,
        router: str,
        info: pb.WorkerInfo,
        stats: Callable[[], WorkerStats],
        security: Security | None = None,
        on_failure: Callable[[], None] = stop_this_process,
    ) -> None:
        self.channel = auth.channel(router, security)
        self.stub = rpc.RouterStub(self.channel)
        self.info = info
        self.stats = stats
        self.on_failure = on_failure
        self.interval_s = HEARTBEAT_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._beat()
        except Exception:
            log.critical("the heartbeat failed; this worker stops", exc_info=True)
            self.on_failure()

    def _beat(self) -> None:
        said: set[grpc.StatusCode] = set()
        while not self._stop.is_set():
            request = pb.RegisterRequest(
                protocol_version=PROTOCOL_VERSION, worker=worker_info(self.info, self.stats())
            )
            # the router may not be up yet or restarting: the next heartbeat retries
            try:
                reply = self.stub.Register(request, timeout=REGISTER_TIMEOUT_S)
            except grpc.RpcError as e:
                if e.code() in _REFUSED and e.code() not in said:
                    said.add(e.code())
                    log.warning("the router refused this worker: %s %s", e.code().name, e.details())
            else:
                said.clear()
                if reply.heartbeat_interval_s > 0:
                    self.interval_s = reply.heartbeat_interval_s
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=REGISTER_TIMEOUT_S + 1)
        self.channel.close()
