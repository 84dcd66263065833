"""The decode worker's gRPC face: Reserve, Start (token stream), Release, Health."""

from __future__ import annotations

import queue
import time

import grpc

from decode.worker import FINISHED, DecodeWorker, ReservationError
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.convert import sampling_from_proto, spans_to_proto
from pdserve.serving.server import health

STREAM_IDLE_S = 60.0


class DecodeService(rpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        try:
            params = sampling_from_proto(request.sampling)
            reserved = self.worker.reserve(
                request.request_id, list(request.prompt_token_ids), params, request.lease_s or 30.0
            )
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ReservationError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        return pb.ReserveResponse(
            block_ids=reserved.block_ids,
            cached_blocks=reserved.cached_blocks,
            layout=pb.KVLayout(**self.worker.wire()),
            agent_metadata=self.worker.agent.metadata(),
            worker_id=self.worker.worker_id,
        )

    def Start(self, request: pb.StartRequest, context):
        try:
            stream = self.worker.start(request.request_id, request.first_token)
        except KeyError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except TimeoutError as e:
            self.worker.release(request.request_id)
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        context.add_callback(lambda: self.worker.release(request.request_id))
        produced = 0
        while True:
            try:
                item = stream.tokens.get(timeout=STREAM_IDLE_S)
            except queue.Empty:
                if self.worker.is_pending(request.request_id):
                    continue  # preempted and waiting for room (recompute or reload): alive
                self.worker.release(request.request_id)
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "decode produced nothing")
            if isinstance(item, tuple) and item[0] is FINISHED:
                # decode-side TPOT: first token handed over -> last token, per later token
                elapsed = time.monotonic() - stream.started
                tpot = elapsed / (produced - 1) if produced > 1 else 0.0
                if produced > 1:
                    self.worker.metrics.tpot.observe(tpot)
                yield pb.TokenChunk(
                    finished=True,
                    finish_reason=item[1],
                    tpot_s=tpot,
                    spans=spans_to_proto(stream.spans),
                )
                return
            produced += 1
            yield pb.TokenChunk(token_ids=[item])

    def Release(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.worker.release(request.request_id))

    def Health(self, request, context) -> pb.HealthResponse:
        return health("decode", self.worker.worker_id)
