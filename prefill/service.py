"""The prefill worker's gRPC face: Prefill (returns after the KV push), Abort, Health."""

from __future__ import annotations

import grpc

from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.convert import sampling_from_proto, spans_to_proto
from pdserve.serving.kv_endpoint import PoolGeometry
from pdserve.serving.server import health
from prefill.worker import Destination, PrefillWorker
from transfer import HandshakeRefused, TransferFailed

PREFILL_TIMEOUT_S = 120.0


class PrefillService(rpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        layout = request.dest_layout
        dest = Destination(
            worker_id=request.dest_worker_id,
            agent_metadata=request.dest_agent_metadata,
            block_ids=list(request.dest_block_ids),
            cached_blocks=request.dest_cached_blocks,
            wire_version=layout.wire_version,
            layout_hash=layout.layout_hash,
            geometry=PoolGeometry(
                num_blocks=layout.num_blocks,
                block_bytes=layout.block_bytes,
                planes_per_layer=max(
                    1, layout.planes // self.worker.engine.model_config.num_layers
                ),
            ),
            region=layout.region,
        )
        try:
            params = sampling_from_proto(request.sampling)
            future = self.worker.submit(
                request.request_id, list(request.prompt_token_ids), params, dest
            )
        except HandshakeRefused as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            result = future.result(timeout=PREFILL_TIMEOUT_S)
        except TransferFailed as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push failed: {e}")
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish in time")
        except (RuntimeError, ValueError) as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
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
