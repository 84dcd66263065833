"""The prefill worker's gRPC face: Prefill (returns after the KV push), Health.

Prefill's failures, typed for the router: INVALID_ARGUMENT (never servable: refused before
it was queued, so nothing was pushed),
FAILED_PRECONDITION (the pair's KV layouts differ), DEADLINE_EXCEEDED (the caller's deadline
passed: nothing is pushed after it), ABORTED (the push into the decode worker failed: retry
with a new reservation, perhaps elsewhere), UNAVAILABLE (this worker failed: another may
succeed). A failure after the request was queued carries UNPOSTED_KEY in its trailers when
no WRITE of it was ever posted (pdserve/rpc): the router then releases its reservation at
once instead of fencing it for the push window."""

from __future__ import annotations

import time

import grpc

from pdserve.rpc import UNPOSTED_KEY
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.convert import sampling_from_proto, spans_to_proto
from pdserve.serving.destination import destination_from_proto
from pdserve.serving.server import health
from prefill.worker import PrefillCancelled, PrefillDeadline, PrefillWorker, nothing_posted
from transfer import HandshakeRefused, TransferFailed


class PrefillService(rpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        try:
            dest = destination_from_proto(request)
            params = sampling_from_proto(request.sampling)
            # the caller's deadline is the one that counts (the router's, inside the push
            # window the decode worker fences for): nothing is pushed after it
            remaining = context.time_remaining()
            timeout = self.worker.config.default_timeout_s if remaining is None else remaining
            future = self.worker.submit(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                dest,
                deadline=time.monotonic() + timeout,
                gone=lambda: not context.is_active(),  # the router cancelled the call
            )
        except HandshakeRefused as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            # a little past the deadline: the job itself fails at its deadline, typed
            result = future.result(timeout=max(0.0, timeout) + 1.0)
        except Exception as e:
            if nothing_posted(e):
                context.set_trailing_metadata(((UNPOSTED_KEY, "1"),))
            _abort(context, e)
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


def _abort(context, e: Exception) -> None:
    """End the call with `e`'s status, typed for the router (module doc)."""
    if isinstance(e, PrefillCancelled):  # nobody is listening; for the logs
        context.abort(grpc.StatusCode.CANCELLED, str(e))
    if isinstance(e, TransferFailed):
        context.abort(grpc.StatusCode.ABORTED, f"KV push failed: {e}")
    if isinstance(e, (PrefillDeadline, TimeoutError)):  # TimeoutError: the wait's own
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill did not finish in time: {e}")
    if isinstance(e, ValueError):  # raised by the batch, after it was queued: not the input's
        context.abort(grpc.StatusCode.ABORTED, f"prefill failed: {e}")
    # the worker's own failure: another worker may succeed
    context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill failed: {e}")
