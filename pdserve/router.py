"""The router: the front door. Worker registry (registration + heartbeats), bounded admission,
worker choice, the reserve -> prefill -> decode handoff, token streaming, per-request timings.

    Generate:  validate -> admit (bounded queue) -> decode.Reserve (most free blocks)
               -> prefill.Prefill (fewest queued tokens; KV pushed layer by layer)
               -> decode.Start -> stream tokens -> final message with timings and text
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, field

import grpc

from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.convert import sampling_from_proto, spans_from_proto, spans_to_proto
from pdserve.serving.metrics import RouterMetrics
from pdserve.serving.server import HEARTBEAT_S, health
from pdserve.trace import Span, hops, now
from pdserve.weights import resolve

MISSED_HEARTBEATS = 5  # then the worker gets no new requests (its streams go on)
FORGET_AFTER_S = 120.0  # then it leaves the registry and its channel is closed
PREFILL_TIMEOUT_S = 180.0
# A lease must outlive the prefill that fills its blocks: blocks returned while a push is
# still running could be handed to another request and overwritten by the late push.
LEASE_S = PREFILL_TIMEOUT_S + 60.0
RESERVE_RETRY_S = (0.01, 0.2)  # first and longest pause between Reserve attempts


@dataclass
class Worker:
    info: pb.WorkerInfo
    last_seen: float
    channel: grpc.Channel
    stub: object
    pending_blocks: int = 0  # reserved by this router since the last heartbeat
    pending_tokens: int = 0


@dataclass
class Registry:
    workers: dict[str, Worker] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def upsert(self, info: pb.WorkerInfo) -> None:
        with self.lock:
            known = self.workers.get(info.worker_id)
            if known is None or known.info.address != info.address:
                channel = grpc.insecure_channel(info.address)
                stub = (rpc.DecodeStub if info.role == "decode" else rpc.PrefillStub)(channel)
                self.workers[info.worker_id] = Worker(info, time.monotonic(), channel, stub)
            else:
                known.info, known.last_seen = info, time.monotonic()
                known.pending_blocks = known.pending_tokens = 0

    def alive(self, role: str) -> list[Worker]:
        """Workers heard from recently. A worker that misses heartbeats (dead, or just slow
        under load) gets no new requests, but its channel stays open for the streams it is
        serving; only a long silence removes it."""
        now = time.monotonic()
        with self.lock:
            for wid in [w for w, x in self.workers.items() if now - x.last_seen > FORGET_AFTER_S]:
                self.workers.pop(wid).channel.close()
            cutoff = now - MISSED_HEARTBEATS * HEARTBEAT_S
            return [
                w for w in self.workers.values() if w.info.role == role and w.last_seen >= cutoff
            ]


class RouterService(rpc.RouterServicer):
    def __init__(
        self, model: str, max_model_len: int | None, max_queue: int, queue_timeout_s: float
    ):
        source = resolve(model)
        self.config = source.config
        self.tokenizer = source.tokenizer
        self.max_model_len = max_model_len or self.config.max_position
        self.registry = Registry()
        self.admission = threading.BoundedSemaphore(max_queue)
        self.queue_timeout_s = queue_timeout_s
        self._ids = itertools.count()
        self.inflight: dict[str, Worker] = {}  # request id -> its decode worker
        self.metrics = RouterMetrics()

    # -- registry -----------------------------------------------------------------------------
    def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        if request.protocol_version != PROTOCOL_VERSION:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} != router's {PROTOCOL_VERSION}",
            )
        self.registry.upsert(request.worker)
        w = request.worker
        if w.role == "decode" and w.total_blocks > 0:
            self.metrics.kv_usage.labels(w.worker_id).set(1 - w.free_blocks / w.total_blocks)
        return pb.RegisterResponse(accepted=True, heartbeat_interval_s=HEARTBEAT_S)

    def ListWorkers(self, request, context) -> pb.ListWorkersResponse:
        now = time.monotonic()
        out = []
        for role in ("prefill", "decode"):
            for w in self.registry.alive(role):
                info = pb.WorkerInfo()
                info.CopyFrom(w.info)
                info.last_heartbeat_age_s = now - w.last_seen
                out.append(info)
        return pb.ListWorkersResponse(workers=out)

    def Health(self, request, context) -> pb.HealthResponse:
        return health("router", "router")

    # -- requests -----------------------------------------------------------------------------
    def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if not request.text:
                raise ValueError("prompt: empty prompt")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; send token ids")
            return self.tokenizer.encode(request.text)
        ids = list(request.token_ids.ids) if kind == "token_ids" else []
        if not ids:
            raise ValueError("prompt: empty prompt")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary")
        return ids

    def _validate(self, request: pb.GenerateRequest):
        if request.protocol_version not in (0, PROTOCOL_VERSION):
            raise ValueError(f"protocol_version: {request.protocol_version} is not supported")
        prompt = self._prompt(request)
        params = sampling_from_proto(request.sampling)
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt length {len(prompt)} + max_tokens {params.max_tokens} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        return prompt, params

    def Generate(self, request: pb.GenerateRequest, context):
        arrival, arrival_wall = time.monotonic(), now()
        try:
            prompt, _ = self._validate(request)
        except ValueError as e:
            self.metrics.requests.labels("invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request_id = request.request_id or f"req-{next(self._ids)}"
        if not self.admission.acquire(blocking=False):
            self.metrics.requests.labels("rejected").inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "router queue is full; retry later")
        try:
            yield from self._serve(
                request_id, prompt, request.sampling, (arrival, arrival_wall), context
            )
        finally:
            self.admission.release()

    def _reserve(self, request_id, prompt, sampling, context, spans: list[Span], since: float):
        """Reserve blocks on the decode worker with the most headroom; records router.queue
        (`since` -> the call that succeeded) and decode.reserve (that call)."""
        deadline = time.monotonic() + self.queue_timeout_s
        pause = RESERVE_RETRY_S[0]
        while True:
            decodes = self.registry.alive("decode")
            if not decodes:
                context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is registered")
            # most projected headroom first (the worker's own projection of free blocks after
            # expected growth), minus what this router reserved since its last heartbeat
            decodes.sort(key=lambda w: w.info.headroom_blocks - w.pending_blocks, reverse=True)
            for worker in decodes:
                asked = now()
                try:
                    reply = worker.stub.Reserve(
                        pb.ReserveRequest(
                            request_id=request_id,
                            prompt_token_ids=prompt,
                            sampling=sampling,
                            lease_s=LEASE_S,
                        ),
                        timeout=10,
                    )
                    worker.pending_blocks += len(reply.block_ids)
                    spans.append(Span("router.queue", since, asked, "router"))
                    spans.append(Span("decode.reserve", asked, now(), worker.info.worker_id))
                    return worker, reply
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.details())
                    if e.code() not in (
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        grpc.StatusCode.UNAVAILABLE,
                    ):
                        raise
            if time.monotonic() > deadline or not context.is_active():
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no decode worker had room for {len(prompt)} prompt tokens within "
                    f"{self.queue_timeout_s}s",
                )
            # back off: many waiting requests polling every 10 ms kept the workers' CPUs busy
            # answering Reserve (seen in the capacity sweep on 2 cores)
            time.sleep(pause)
            pause = min(RESERVE_RETRY_S[1], pause * 2)

    def _serve(self, request_id, prompt, sampling, arrived, context):
        arrival, arrival_wall = arrived
        spans: list[Span] = []
        decode, reserved = self._reserve(
            request_id, prompt, sampling, context, spans, since=arrival_wall
        )
        self.inflight[request_id] = decode
        context.add_callback(lambda: self._release(request_id))
        queued = time.monotonic()
        prefills = self.registry.alive("prefill")
        if not prefills:
            self._release(request_id)
            context.abort(grpc.StatusCode.UNAVAILABLE, "no prefill worker is registered")
        prefill = min(prefills, key=lambda w: w.info.queued_tokens + w.pending_tokens)
        prefill.pending_tokens += len(prompt)
        prefill_sent = now()
        try:
            done = prefill.stub.Prefill(
                pb.PrefillRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    dest_worker_id=reserved.worker_id,
                    dest_block_ids=reserved.block_ids,
                    dest_cached_blocks=reserved.cached_blocks,
                    dest_layout=reserved.layout,
                    dest_agent_metadata=reserved.agent_metadata,
                ),
                timeout=PREFILL_TIMEOUT_S,
            )
        except grpc.RpcError as e:
            self._release(request_id)
            context.abort(e.code(), f"prefill failed: {e.details()}")
        prefill_back = start_sent = now()
        stream = decode.stub.Start(
            pb.StartRequest(request_id=request_id, first_token=done.first_token), timeout=3600
        )
        context.add_callback(stream.cancel)
        tokens: list[int] = []
        first_at = None
        try:
            for chunk in stream:
                if chunk.token_ids:
                    tokens.extend(chunk.token_ids)
                    if first_at is None:
                        first_at = time.monotonic()
                    yield pb.GenerateResponse(request_id=request_id, token_ids=chunk.token_ids)
                if chunk.finished:
                    end, end_wall = time.monotonic(), now()
                    timings = pb.Timings(
                        queue_s=queued - arrival,
                        prefill_s=done.prefill_s,
                        transfer_s=done.transfer_s,
                        ttft_s=(first_at or end) - arrival,
                        tpot_s=chunk.tpot_s,
                        e2e_s=end - arrival,
                        prefill_worker=done.worker_id,
                        decode_worker=reserved.worker_id,
                        arrival_unix=arrival_wall,
                        end_unix=end_wall,
                    )
                    text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
                    self.metrics.queue.observe(timings.queue_s)
                    self.metrics.ttft.observe(timings.ttft_s)
                    self.metrics.e2e.observe(timings.e2e_s)
                    self.metrics.transfer.observe(timings.transfer_s)
                    self.metrics.transfer_bytes.inc(done.transfer_bytes)
                    if len(tokens) > 1:
                        self.metrics.tpot.observe(timings.tpot_s)
                    self.metrics.requests.labels(chunk.finish_reason).inc()
                    yield pb.GenerateResponse(
                        request_id=request_id,
                        finished=True,
                        finish_reason=chunk.finish_reason,
                        timings=timings,
                        text=text,
                        trace=[
                            *spans_to_proto(spans),
                            *done.spans,
                            *chunk.spans,
                            *spans_to_proto(
                                hops(
                                    (prefill_sent, prefill_back, start_sent, end_wall),
                                    spans_from_proto(done.spans),
                                    spans_from_proto(chunk.spans),
                                )
                            ),
                        ],
                        prompt_tokens=len(prompt),
                    )
                    return
        except grpc.RpcError as e:
            if context.is_active():
                context.abort(e.code(), f"decode failed: {e.details()}")
        finally:
            self.inflight.pop(request_id, None)

    def _release(self, request_id: str) -> None:
        worker = self.inflight.pop(request_id, None)
        if worker is not None:
            # if the worker is gone, its leases return the blocks
            with contextlib.suppress(grpc.RpcError):
                worker.stub.Release(pb.AbortRequest(request_id=request_id), timeout=5)

    def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        found = request.request_id in self.inflight
        self._release(request.request_id)
        return pb.AbortResponse(found=found)
