"""The router's gRPC service: Generate (validate -> bounded admission -> the handoff),
Abort, and the worker registry's Register / ListWorkers, and Health (ready only once at
least one prefill and one decode worker are registered).

Request ownership: a request belongs to whoever created it (its API key, or its connection
when the router has no keys; pdserve/serving/auth.py). Only its owner or a cluster member can
abort it; anyone else is told found=False, as for an id that does not exist. Ids the router
assigns are random (128 bits); an id a client chooses that is already in use is refused with
the same answer whoever owns the first, so a refusal says nothing about it."""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time

import grpc

from pdserve.router.config import RouterConfig
from pdserve.router.handoff import Handoff, Inflight
from pdserve.router.metrics import RouterMetrics
from pdserve.router.migrate import Mover
from pdserve.router.periodic import Periodic
from pdserve.router.rebalance import Rebalancer
from pdserve.router.registry import WorkerRecord, WorkerRegistry, grpc_connect
from pdserve.router.request import Arrival, RecentIds
from pdserve.rpc import ACCEPTED_KEY, GENERATE_VERSIONS, PROTOCOL_VERSION, STATUS_KEY
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving import auth
from pdserve.serving.auth import MEMBER, Security
from pdserve.serving.convert import sampling_from_proto
from pdserve.serving.registration import MAX_PARKED_IDS, WorkerStats
from pdserve.serving.server import health
from pdserve.tokenizer import Tokenizer
from pdserve.trace import now
from pdserve.validation import RequestValidator

log = logging.getLogger(__name__)

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_WORKER_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ADDRESS = re.compile(r"[A-Za-z0-9._-]{1,253}:[0-9]{1,5}|\[[0-9A-Fa-f:.]{2,45}\]:[0-9]{1,5}")
# a block or token count beyond this is not a count any worker reports
_COUNT_MAX = 1 << 30


def check_worker_info(info: pb.WorkerInfo) -> None:
    """A registration's claims must be ones a real worker could make: a fake prefill worker
    advertising queued_tokens=-1e9 would attract every request."""
    if info.role not in ("prefill", "decode"):
        raise ValueError(f"worker.role: must be prefill or decode, got {info.role[:32]!r}")
    if not _WORKER_ID.fullmatch(info.worker_id):
        raise ValueError("worker.worker_id: 1-128 characters of [A-Za-z0-9._:-]")
    for name in ("address", "metrics_address"):
        value = getattr(info, name)
        if name == "metrics_address" and not value:
            continue  # a worker may serve no /metrics
        if not _ADDRESS.fullmatch(value) or not 0 < int(value.rsplit(":", 1)[1]) < 65536:
            raise ValueError(f"worker.{name}: expected host:port, got {value[:64]!r}")
    for name in ("free_blocks", "total_blocks", "queued_tokens", "running"):
        if not 0 <= getattr(info, name) <= _COUNT_MAX:
            raise ValueError(f"worker.{name}: must be in [0, {_COUNT_MAX}]")
    if info.free_blocks > info.total_blocks:
        raise ValueError("worker.free_blocks: exceeds total_blocks")
    if not -_COUNT_MAX <= info.headroom_blocks <= _COUNT_MAX:
        raise ValueError(f"worker.headroom_blocks: must be in [-{_COUNT_MAX}, {_COUNT_MAX}]")
    if not -_COUNT_MAX <= info.projected_free_blocks <= _COUNT_MAX:
        raise ValueError(f"worker.projected_free_blocks: must be in [-{_COUNT_MAX}, {_COUNT_MAX}]")
    if not 0 <= info.preempted <= _COUNT_MAX:
        raise ValueError(f"worker.preempted: must be in [0, {_COUNT_MAX}]")
    if len(info.parked_request_ids) > MAX_PARKED_IDS:
        raise ValueError(f"worker.parked_request_ids: at most {MAX_PARKED_IDS}")
    if any(not 0 < len(rid) <= 256 for rid in info.parked_request_ids):
        raise ValueError("worker.parked_request_ids: each 1-256 characters")


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
            preempted=info.preempted,
            parked=tuple(info.parked_request_ids),
            projected_free_blocks=(
                info.projected_free_blocks if info.HasField("projected_free_blocks") else None
            ),
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
        preempted=s.preempted,
        parked_request_ids=list(s.parked),
        projected_free_blocks=s.projected_free_blocks,
        last_heartbeat_age_s=age_s,
    )


class RouterService(rpc.RouterServicer):
    def __init__(
        self,
        config: RouterConfig,
        vocab_size: int,
        tokenizer: Tokenizer | None,
        security: Security | None = None,
    ) -> None:
        self.config = config
        self.security = security or Security()
        self.tokenizer = tokenizer
        self.validator = RequestValidator(
            vocab_size=vocab_size, max_model_len=config.max_model_len, tokenizer=tokenizer
        )
        self.metrics = RouterMetrics()
        self.registry = WorkerRegistry(
            config,
            connect=lambda record: grpc_connect(record, self.security),
            on_forget=self._forget_worker,
        )
        self.admission = threading.BoundedSemaphore(config.max_queue)
        self.inflight: dict[str, Inflight] = {}  # request id -> its decode worker
        self._owners: dict[str, str] = {}  # request id -> who created it (Security.caller)
        self._owners_lock = threading.Lock()
        self._recent = RecentIds()  # ids ended lately (a new request under one: its own tag)
        self.handoff = Handoff(config, self.registry, self.metrics, tokenizer, self.inflight)
        self.mover = Mover(config, self.registry, self.metrics, self.handoff)
        self.rebalancer = None
        if config.migrate_policy == "pressure":
            rebalancer = Rebalancer(config, self.registry, self.handoff, self.mover)
            self.rebalancer = Periodic(
                "router-rebalance", config.rebalance_period_s, rebalancer.tick
            )

    def close(self) -> None:
        """Stops the handoff's lease and stream-watch threads (and the rebalancer's)."""
        if self.rebalancer is not None:
            self.rebalancer.close()
        self.handoff.close()

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
        try:
            check_worker_info(request.worker)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        record = record_from_proto(request.worker)
        if not self.registry.knows(record) and (why := self._unreachable(record)):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker.address: the router cannot reach {record.address} ({why})",
            )
        self.registry.upsert(record)
        s = record.stats
        if record.role == "decode":
            self.handoff.line.kick()  # its room may have changed: the line's head asks again
        if record.role == "decode" and s.total_blocks > 0:
            self.metrics.kv_usage.labels(record.worker_id).set(1 - s.free_blocks / s.total_blocks)
        return pb.RegisterResponse(accepted=True, heartbeat_interval_s=self.config.heartbeat_s)

    def _unreachable(self, record: WorkerRecord) -> str:
        """A new worker (or one at a new address) is asked for its Health before it gets
        any traffic: one that accepts connections and never answers, or that advertises an
        address the router cannot reach, is refused ("" when it answered, whatever it said)."""
        with auth.channel(record.address, self.security) as channel:
            stub = rpc.DecodeStub(channel) if record.role == "decode" else rpc.PrefillStub(channel)
            try:
                stub.Health(pb.Empty(), timeout=self.config.probe_timeout_s)
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    return f"{e.code().name}: {(e.details() or '')[:120]}"
        return ""

    def ListWorkers(self, request, context) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse(
            workers=[record_to_proto(r, age) for r, age in self.registry.listing()]
        )

    def Health(self, request, context) -> pb.HealthResponse:
        return health("router", "router", reason=self.registry.not_ready())

    def Drain(self, request: pb.DrainRequest, context):
        """Cluster members only (pdserve/serving/auth.py: a method not listed is shut)."""
        worker = self.registry.find(request.worker_id, "decode")
        if worker is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"worker_id: no live decode worker {request.worker_id[:128]!r}",
            )
        if request.undo:
            self.registry.drain(worker, undo=True)
            yield pb.DrainProgress(done=True)
            return
        for progress in self.mover.drain(worker):
            if progress.done and request.stop:
                progress.stopped = self._shutdown(worker)
            yield progress

    def _shutdown(self, worker) -> bool:
        """Tell a drained decode worker to stop -> whether it said it will."""
        try:
            worker.stub.Shutdown(pb.Empty(), timeout=self.config.release_rpc_timeout_s)
        except grpc.RpcError as e:
            log.warning("%s was drained but not stopped: %s", worker.worker_id, e.code().name)
            return False
        log.info("%s drained and told to stop", worker.worker_id)
        return True

    # -- requests -----------------------------------------------------------------------------
    def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return self.validator.prompt(request.text)
        return self.validator.prompt(request.token_ids.ids if kind == "token_ids" else [])

    def _validate(self, request: pb.GenerateRequest) -> tuple[list[int], tuple[int, ...]]:
        """-> (prompt, continuation)"""
        if request.protocol_version not in GENERATE_VERSIONS:
            raise ValueError(f"protocol_version: {request.protocol_version} is not supported")
        if request.request_id and not REQUEST_ID.fullmatch(request.request_id):
            raise ValueError("request_id: 1-128 characters of [A-Za-z0-9._:-]")
        prompt = self._prompt(request)
        params = sampling_from_proto(request.sampling)
        self.validator.request(prompt, params)
        continued = request.continuation.ids
        if not continued:
            return prompt, ()
        if len(continued) > params.max_tokens:
            raise ValueError(
                f"continuation: {len(continued)} tokens, more than max_tokens {params.max_tokens}"
            )
        return prompt, tuple(self.validator.prompt(continued, "continuation"))

    def Generate(self, request: pb.GenerateRequest, context):
        arrived, arrived_wall = time.monotonic(), now()
        # on every status this router ends the call with: a client tells them from a
        # broken connection (a router that died), which it may resume (pdserve/client.py)
        context.send_initial_metadata(((ACCEPTED_KEY, "1"),))
        context.set_trailing_metadata(((STATUS_KEY, "1"),))
        try:
            prompt, continued = self._validate(request)
        except ValueError as e:
            self.metrics.requests.labels("invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request_id = request.request_id or f"req-{secrets.token_hex(16)}"
        if not self._claim(request_id, self.security.caller(context)):
            self.metrics.requests.labels("invalid").inc()
            context.abort(grpc.StatusCode.ALREADY_EXISTS, "request_id: already in use")
        try:
            if not self.admission.acquire(blocking=False):
                self.metrics.requests.labels("rejected").inc()
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "router queue is full; retry later"
                )
            try:
                # its own id on the workers when they may still hold another request under
                # its id: a continued one's (the router that died may have left a
                # reservation there), or one whose id ended lately (a client that cancelled
                # and sent again under the same id)
                tag = self._recent.worker_id(request_id, request.HasField("continuation"))
                arrival = Arrival(
                    request_id, prompt, request.sampling, arrived, arrived_wall, continued, tag
                )
                yield from self._served(arrival, context)
            finally:
                self.admission.release()
        finally:
            if request.request_id:  # (the router's own ids are random: never sent again)
                self._recent.ended(request_id)  # before the id is free for a new request
            with self._owners_lock:
                del self._owners[request_id]

    def _served(self, arrival: Arrival, context):
        """The handoff's messages, and the request's outcome counted once: its finish reason
        (stop, length, abort), `cancelled` (the client went away, whatever the workers
        answered after) or `failed_<status>` (the router gave up with that status)."""
        outcome = None
        try:
            for msg in self.handoff.serve(arrival, context):
                if msg.finished:
                    outcome = msg.finish_reason if context.is_active() else "cancelled"
                yield msg
            if outcome is None and context.is_active():
                # every request ends with its final message or a status: a stream closed
                # with neither would leave the client holding a truncated output as if it
                # were whole (counted failed_internal, and logged: it is a router bug)
                log.error(
                    "request %s: the handoff ended without a final message", arrival.request_id
                )
                context.abort(
                    grpc.StatusCode.INTERNAL,
                    "the router ended the request without its final message (a bug)",
                )
        except GeneratorExit:  # gRPC closes the generator of a cancelled call
            outcome = outcome or "cancelled"
            raise
        finally:
            if outcome is None and not context.is_active() and context.code() is None:
                outcome = "cancelled"  # the handoff saw the cancel first and just stopped
            if outcome is None:
                code = context.code() or grpc.StatusCode.UNKNOWN
                outcome = f"failed_{code.name.lower()}"
            self.metrics.requests.labels(outcome).inc()

    def _forget_worker(self, worker_id: str) -> None:
        """A worker left the registry: its series and its feed go."""
        self.metrics.forget_worker(worker_id)
        self.handoff.feeds.forget(worker_id)

    def _claim(self, request_id: str, owner: str) -> bool:
        with self._owners_lock:
            if request_id in self._owners:
                return False
            self._owners[request_id] = owner
            return True

    def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        rid, caller = request.request_id, self.security.caller(context)
        with self._owners_lock:  # the owner and the entry looked up together
            owner = self._owners.get(rid)
            entry = self.inflight.get(rid)
        if owner is None or caller not in (owner, MEMBER) or entry is None:
            return pb.AbortResponse(found=False)
        return pb.AbortResponse(found=self.handoff.release(rid, entry))
