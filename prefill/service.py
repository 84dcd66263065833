"""The prefill worker's gRPC face: Prefill (returns after the KV push), Health."""

from __future__ import annotations

import grpc

from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.convert import sampling_from_proto, spans_to_proto
from pdserve.serving.kv_pool import layout_from_proto
from pdserve.serving.server import health
from prefill.push import Destination
from prefill.worker import PrefillWorker
from transfer import HandshakeRefused, TransferFailed


class PrefillService(rpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        try:
            dest = Destination(
                worker_id=request.dest_worker_id,
                agent_metadata=request.dest_agent_metadata,
                pool=layout_from_proto(request.dest_layout),
                block_ids=list(request.dest_block_ids),
                cached_blocks=request.dest_cached_blocks,
            )
            params = sampling_from_proto(request.sampling)
            future = self.worker.submit(
                request.request_id, list(request.prompt_token_ids), params, dest
            )
        except HandshakeRefused as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # the caller's deadline is the one that counts (the router's prefill timeout)
        remaining = context.time_remaining()
        timeout = self.worker.config.default_timeout_s if remaining is None else remaining
        try:
            result = future.result(timeout=max(0.0, timeout))
        except TransferFailed as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push failed: {e}")
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish in time")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # the worker's own failure: another worker may succeed
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill failed: {e}")
        return pb.PrefillResponse(
            first_token=result.first_token,
            queue_s=result.queue_s,
            prefill_s=result.prefill_s,
            transfer_s=result.transfer_s,
            transfer_bytes=result.transfer_bytes,
            worker_id=self.worker.worker_id,
            spans=spans_to_proto(result.spans),
        )

    def Health(self, request, context) -> pb.HealthResponse:
        return health("prefill", self.worker.worker_id)
