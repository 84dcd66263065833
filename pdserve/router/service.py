"""The router's gRPC service: Generate (validate -> bounded admission -> the handoff),
Abort, and the worker registry's Register / ListWorkers, and Health (ready only once at
least one prefill and one decode worker are registered)."""

from __future__ import annotations

import itertools
import threading
import time

import grpc

from pdserve.router.config import RouterConfig
from pdserve.router.handoff import Arrival, Handoff
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import Worker, WorkerRecord, WorkerRegistry
from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.convert import sampling_from_proto
from pdserve.serving.registration import WorkerStats
from pdserve.serving.server import health
from pdserve.tokenizer import Tokenizer
from pdserve.trace import now
from pdserve.validation import RequestValidator


def record_from_proto(info: pb.WorkerInfo) -> WorkerRecord:
    return WorkerRecord(
        worker_id=info.worker_id,
        role=info.role,
        address=info.address,
        metrics_address=info.metrics_address,
        stats=WorkerStats(
            free_blocks=info.free_blocks,
            total_blocks=info.total_blocks,
            running=info.running,
            queued_tokens=info.queued_tokens,
            headroom_blocks=info.headroom_blocks,
        ),
    )


def record_to_proto(record: WorkerRecord, age_s: float) -> pb.WorkerInfo:
    s = record.stats
    return pb.WorkerInfo(
        worker_id=record.worker_id,
        role=record.role,
        address=record.address,
        metrics_address=record.metrics_address,
        free_blocks=s.free_blocks,
        total_blocks=s.total_blocks,
        queued_tokens=s.queued_tokens,
        running=s.running,
        headroom_blocks=s.headroom_blocks,
        last_heartbeat_age_s=age_s,
    )


class RouterService(rpc.RouterServicer):
    def __init__(self, config: RouterConfig, vocab_size: int, tokenizer: Tokenizer | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.validator = RequestValidator(
            vocab_size=vocab_size, max_model_len=config.max_model_len, tokenizer=tokenizer
        )
        self.registry = WorkerRegistry(config)
        self.metrics = RouterMetrics()
        self.admission = threading.BoundedSemaphore(config.max_queue)
        self._ids = itertools.count()
        self.inflight: dict[str, Worker] = {}  # request id -> its decode worker
        self.handoff = Handoff(config, self.registry, self.metrics, tokenizer, self.inflight)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # -- registry -----------------------------------------------------------------------------
    def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        if request.protocol_version != PROTOCOL_VERSION:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} != router's {PROTOCOL_VERSION}",
            )
        record = record_from_proto(request.worker)
        self.registry.upsert(record)
        s = record.stats
        if record.role == "decode" and s.total_blocks > 0:
            self.metrics.kv_usage.labels(record.worker_id).set(1 - s.free_blocks / s.total_blocks)
        return pb.RegisterResponse(accepted=True, heartbeat_interval_s=self.config.heartbeat_s)

    def ListWorkers(self, request, context) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse(
            workers=[record_to_proto(r, age) for r, age in self.registry.listing()]
        )

    def Health(self, request, context) -> pb.HealthResponse:
        return health("router", "router", reason=self.registry.not_ready())

    # -- requests -----------------------------------------------------------------------------
    def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return self.validator.prompt(request.text)
        return self.validator.prompt(list(request.token_ids.ids) if kind == "token_ids" else [])

    def _validate(self, request: pb.GenerateRequest) -> list[int]:
        if request.protocol_version not in (0, PROTOCOL_VERSION):
            raise ValueError(f"protocol_version: {request.protocol_version} is not supported")
        prompt = self._prompt(request)
        self.validator.request(prompt, sampling_from_proto(request.sampling))
        return prompt

    def Generate(self, request: pb.GenerateRequest, context):
        arrived, arrived_wall = time.monotonic(), now()
        try:
            prompt = self._validate(request)
        except ValueError as e:
            self.metrics.requests.labels("invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request_id = request.request_id or f"req-{next(self._ids)}"
        if not self.admission.acquire(blocking=False):
            self.metrics.requests.labels("rejected").inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "router queue is full; retry later")
        try:
            arrival = Arrival(request_id, prompt, request.sampling, arrived, arrived_wall)
            yield from self.handoff.serve(arrival, context)
        finally:
            self.admission.release()

    def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        found = request.request_id in self.inflight
        self.handoff.release(request.request_id)
        return pb.AbortResponse(found=found)
