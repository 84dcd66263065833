"""Live KV migration, as the router drives it: a streaming request moves from its decode
worker A to another one, B, without recomputing anything and without its client seeing
more than a short stall.

    B.Reserve(the context the client has been sent, all but its last token; room for
              `migrate_extra_tokens` more)             -> blocks, with a fencing token
    A.Migrate(into those blocks)    A moves the KV in pre-copy rounds while it decodes on,
                                    stops the request at a step boundary, moves the rest,
                                    and ends its stream "migrated" (decode/migrate.py)
    B.Start(the tokens sent since the Reserve, first_token_sent)   the stream goes on

The stream relay (pdserve/router/handoff.py) makes the switch when A's stream ends
"migrated"; this side only reserves and asks. A Handover decides who owns B's reservation:
the stream once it switched, else the mover, which releases it when the move failed (its
blocks fenced until the move's push window is over). Whatever fails, the request is never
lost: a failed move leaves it decoding on A; a switch to a B that died resumes it by
recompute like any failed stream.

Drain (`pdserve drain WORKER_ID`): the worker gets no new requests, and every request it
streams is moved to the decode worker with the most room, again and again until none is
left or `drain_timeout_s` passes (requests still prefilling for it are moved once they
stream).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from pdserve.router.config import RouterConfig
from pdserve.router.handoff import Handoff, Handover, Inflight, destination_fields
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import Worker, WorkerRegistry
from pdserve.rpc import pdserve_pb2 as pb

log = logging.getLogger(__name__)

_CALL_ERRORS = (grpc.RpcError, ValueError)  # ValueError: a channel the registry closed
_NOTHING_WRITTEN = grpc.StatusCode.FAILED_PRECONDITION  # the source's Migrate: none in flight
_PAUSE_S = 0.05  # between a drain's passes over the requests still on the worker


@dataclass(frozen=True)
class Moved:
    ok: bool
    why: str = ""  # when not ok
    blocks: int = 0  # when ok: the blocks the destination reserved for it (0: not known)


class Mover:
    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        handoff: Handoff,
    ) -> None:
        self.config, self.registry, self.metrics, self.handoff = config, registry, metrics, handoff

    def move(self, entry: Inflight, dest: Worker) -> Moved:
        """Move the request of `entry` to `dest` -> whether it moved (when not, it goes on
        where it was, or resumes by recompute if its worker failed meanwhile)."""
        handoff = self.handoff
        with handoff.lock:
            src, src_id, run = entry.worker, entry.worker_request_id, entry.run
            if src is None or run is None or entry.released or entry.handover is not None:
                return Moved(False, "not streaming")
            if not entry.streaming or not run.tokens or src is dest:
                return Moved(False, "not streaming")
            sent = list(run.tokens)
            new_id = f"{src_id}~m{run.migrations + 1}"
        sampling = run.remaining()
        sampling.max_tokens += 1  # the client's last token counts again on the destination
        extra = min(self.config.migrate_extra_tokens, sampling.max_tokens)
        window = self.config.migrate_timeout_s + self.config.push_margin_s
        try:
            reply = dest.stub.Reserve(
                pb.ReserveRequest(
                    request_id=new_id,
                    prompt_token_ids=run.arrival.prompt + sent[:-1],
                    sampling=sampling,
                    lease_s=self.config.lease_s,
                    push_window_s=window,
                    extra_tokens=extra,
                    # the prompt ends with every sent token but the last (it counts again)
                    generated_tokens=len(sent) - 1,
                ),
                timeout=self.config.reserve_rpc_timeout_s,
            )
        except _CALL_ERRORS as e:
            return self._failed(f"reserve on {dest.worker_id}: {_details(e)}")
        handover = Handover(dest, new_id, len(sent))
        with handoff.lock:
            if entry.worker is not src or entry.released or entry.handover is not None:
                handoff.release_later(dest, new_id, unpushed=True)
                return self._failed("the request moved on meanwhile")
            entry.handover = handover
        lease = handoff.leases.hold(dest, new_id, reply.fence)
        try:
            src.stub.Migrate(
                pb.MigrateRequest(
                    request_id=src_id,
                    dest_request_id=new_id,
                    **destination_fields(reply),
                ),
                timeout=self.config.migrate_timeout_s,
            )
            # moved: its stream's end ("migrated") may still be on its way here
            handover.switched.wait(self.config.migrate_timeout_s)
            why, unpushed = "", False
        except _CALL_ERRORS as e:
            why = f"migrate from {src.worker_id}: {_details(e)}"
            # no WRITE of it can still land (refused before any, say): no fence needed
            unpushed = isinstance(e, grpc.RpcError) and e.code() == _NOTHING_WRITTEN
        finally:
            handoff.leases.drop(lease)
        with handoff.lock:
            state = handover.state
            if state == "moving":  # the stream did not take it: ours to release
                handover.state = "abandoned"
                if entry.handover is handover:
                    entry.handover = None
        if state == "moving":
            # a WRITE may have landed (unless it said none was posted): fenced until the
            # move's window is over
            handoff.release_later(dest, new_id, unpushed=unpushed)
            return self._failed(why or "the stream never ended 'migrated'")
        if state == "cancelled":  # the stream released it
            return self._failed("the request was aborted while it moved")
        self.metrics.migrations.labels("completed").inc()
        return Moved(True, blocks=len(reply.block_ids))

    def _failed(self, why: str) -> Moved:
        log.warning("a live migration failed: %s", why)
        self.metrics.migrations.labels("failed").inc()
        return Moved(False, why)

    # -- drain ------------------------------------------------------------------------------
    def drain(self, worker: Worker) -> Iterator[pb.DrainProgress]:
        """Move every request off `worker` (it gets no new ones) -> one progress message per
        request moved or given up on this pass, the last with done set."""
        self.registry.drain(worker)
        moved = failed = 0
        deadline = time.monotonic() + self.config.drain_timeout_s
        while True:
            on_it = self._requests_on(worker)
            if not on_it:
                yield pb.DrainProgress(moved=moved, failed=failed, remaining=0, done=True)
                return
            if time.monotonic() > deadline:
                yield pb.DrainProgress(moved=moved, failed=failed, remaining=len(on_it))
                return
            streaming = [e for e in on_it if e.streaming and e.handover is None]
            for entry in streaming:
                dest = self.registry.pick_decode({worker.worker_id})
                if dest is None:
                    break  # no other decode worker now: try again on the next pass
                self.registry.not_reserved(dest)  # the move's Reserve is not a request's
                result = self.move(entry, dest)
                if result.ok:
                    moved += 1
                else:
                    failed += 1
                remaining = len(self._requests_on(worker))
                yield pb.DrainProgress(moved=moved, failed=failed, remaining=remaining)
            time.sleep(_PAUSE_S)

    def _requests_on(self, worker: Worker) -> list[Inflight]:
        with self.handoff.lock:
            return [e for e in self.handoff.inflight.values() if e.worker is worker]


def _details(e: Exception) -> str:
    return (e.details() if isinstance(e, grpc.RpcError) else str(e)) or ""
