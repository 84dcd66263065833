"""The decode worker's gRPC face: Reserve, Renew, Start (token stream), Release, Health,
Migrate (move a running request's KV to another decode worker), Shutdown (stop as on
SIGTERM: the router's Drain with stop calls it once nothing is left here)."""

from __future__ import annotations

import queue
from collections.abc import Callable

import grpc

from decode.streams import EndEvent
from decode.worker import (
    DecodeWorker,
    KVNotArrived,
    MigrationFailed,
    ReservationError,
    UnknownRequest,
)
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.convert import sampling_from_proto, spans_to_proto
from pdserve.serving.destination import destination_from_proto
from pdserve.serving.kv_pool import layout_to_proto, ranks_to_proto
from pdserve.serving.registration import stop_this_process
from pdserve.serving.server import health

STREAM_FAILPOINT_AT = 4  # decode.stream strikes once a stream handed this many tokens over


class DecodeService(rpc.DecodeServicer):
    def __init__(
        self, worker: DecodeWorker, on_shutdown: Callable[[], None] = stop_this_process
    ) -> None:
        self.worker = worker
        self.on_shutdown = on_shutdown  # the process's own graceful stop (SIGTERM)

    def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        try:
            params = sampling_from_proto(request.sampling)
            reserved = self.worker.reserve(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                request.lease_s,
                request.push_window_s,
                request.extra_tokens,
            )
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ReservationError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        endpoint = self.worker.endpoint
        return pb.ReserveResponse(
            block_ids=reserved.block_ids,
            cached_blocks=reserved.cached_blocks,
            headroom_cost_blocks=reserved.headroom_cost,
            layout=layout_to_proto(endpoint.layout),
            agent_metadata=endpoint.agent.metadata(),
            worker_id=self.worker.worker_id,
            fence=reserved.fence,
            ranks=ranks_to_proto(endpoint),
        )

    def Renew(self, request: pb.RenewRequest, context) -> pb.RenewResponse:
        try:
            found = self.worker.renew(request.request_id, request.fence, request.lease_s)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.RenewResponse(found=found)

    def Start(self, request: pb.StartRequest, context):
        worker, rid = self.worker, request.request_id
        try:
            if request.prefill_here:
                stream = worker.start_here(rid)
            else:
                stream = worker.start(
                    rid,
                    request.first_token,
                    list(request.more_token_ids),
                    request.first_token_sent,
                )
        except UnknownRequest as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:  # a migration's tokens outgrew its reservation (now ended)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except KVNotArrived as e:
            worker.release(rid)
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        context.add_callback(lambda: worker.release(rid))
        produced = 0
        while True:
            try:
                event = stream.events.get(timeout=worker.config.stream_idle_s)
            except queue.Empty:
                if worker.is_pending(rid):
                    continue  # preempted and waiting for room (recompute or reload): alive
                worker.release(rid)
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "decode produced nothing")
            if isinstance(event, EndEvent):
                last = [] if event.last_token is None else [event.last_token]
                produced += len(last)
                # decode-side TPOT: first token handed over -> last token, per later token
                tpot = stream.tpot(produced)
                if produced > 1:
                    worker.metrics.tpot.observe(tpot)
                yield pb.TokenChunk(
                    token_ids=last,
                    finished=True,
                    finish_reason=event.finish_reason,
                    tpot_s=tpot,
                    spans=spans_to_proto(stream.spans),
                )
                return
            produced += 1
            yield pb.TokenChunk(token_ids=[event.token])
            if produced == STREAM_FAILPOINT_AT:
                worker.config.failpoints.hit("decode.stream", rid)

    def Migrate(self, request: pb.MigrateRequest, context) -> pb.MigrateResponse:
        try:
            dest = destination_from_proto(request)
            # the caller's deadline counts: the router fences the reservation for it
            moved = self.worker.migrate(
                request.request_id,
                dest,
                request.dest_request_id,
                request.max_rounds,
                context.time_remaining(),
            )
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except MigrationFailed as e:
            # ABORTED: a WRITE may still land, the destination must fence its blocks
            code = grpc.StatusCode.ABORTED if e.wrote else grpc.StatusCode.FAILED_PRECONDITION
            context.abort(code, str(e))
        return pb.MigrateResponse(
            rounds=moved.rounds,
            bytes=moved.nbytes,
            num_tokens=moved.num_tokens,
            stall_s=moved.stall_s,
        )

    def Release(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.worker.release(request.request_id, request.unpushed))

    def Health(self, request, context) -> pb.HealthResponse:
        return health("decode", self.worker.worker_id)

    def Shutdown(self, request, context) -> pb.Empty:
        self.on_shutdown()  # returns at once: the stop runs on the main thread
        return pb.Empty()
