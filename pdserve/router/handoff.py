"""One request's way through the cluster, as the router drives it:

    wait for workers -> decode.Reserve (most projected headroom; retried with backoff while
    none has room) -> prefill.Prefill (fewest queued tokens; KV pushed into the reserved
    blocks) -> decode.Start -> tokens streamed to the client -> final message with timings,
    text and every process's spans

A request that arrives before both roles are registered waits in the queue like one that
waits for room, up to the queue timeout, then fails UNAVAILABLE. Whatever ends the request
early (the client cancels, a call fails), the decode worker is told to release its blocks;
if it is gone, its lease returns them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import Worker, WorkerRegistry
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.serving.convert import spans_from_proto, spans_to_proto
from pdserve.tokenizer import Tokenizer
from pdserve.trace import Span, hops, now

# a worker that refuses the router's own credentials is a deployment fault (a secret or
# certificate that differs between members), not the client's: the client sees UNAVAILABLE
_INTERNAL_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def _to_client(code: grpc.StatusCode) -> grpc.StatusCode:
    return grpc.StatusCode.UNAVAILABLE if code in _INTERNAL_REFUSALS else code


@dataclass(eq=False)
class Inflight:
    """One request's entry in the in-flight table. Compared by identity: a request that
    ended and a later one that reuses its id are different entries, so the first one's
    late release cannot touch the second."""

    worker: Worker


@dataclass(frozen=True)
class Arrival:
    request_id: str
    prompt: list[int]
    sampling: pb.SamplingParams
    at: float  # time.monotonic()
    at_wall: float  # time.time()


class Handoff:
    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        tokenizer: Tokenizer | None,
        inflight: dict[str, Inflight],
    ) -> None:
        self.config, self.registry, self.metrics = config, registry, metrics
        self.tokenizer = tokenizer
        self.inflight = inflight  # request id -> its entry (shared with Abort)
        self._lock = threading.Lock()  # every check-and-change of `inflight`

    def serve(self, arrival: Arrival, context) -> Iterator[pb.GenerateResponse]:
        rid, prompt = arrival.request_id, arrival.prompt
        spans: list[Span] = []
        deadline = arrival.at + self.config.queue_timeout_s
        self._await_workers(deadline, context)
        decode, reserved = self._reserve(arrival, deadline, context, spans)
        entry = Inflight(decode)
        with self._lock:
            self.inflight[rid] = entry
        context.add_callback(lambda: self.release(rid, entry))
        queued = time.monotonic()
        prefill = self.registry.pick_prefill(len(prompt))
        if prefill is None:
            self.release(rid, entry)
            context.abort(grpc.StatusCode.UNAVAILABLE, "no prefill worker is registered")
        prefill_sent = now()
        try:
            done = prefill.stub.Prefill(
                pb.PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    sampling=arrival.sampling,
                    dest_worker_id=reserved.worker_id,
                    dest_block_ids=reserved.block_ids,
                    dest_cached_blocks=reserved.cached_blocks,
                    dest_layout=reserved.layout,
                    dest_agent_metadata=reserved.agent_metadata,
                ),
                timeout=self.config.prefill_timeout_s,
            )
        except grpc.RpcError as e:
            self.release(rid, entry)
            context.abort(_to_client(e.code()), f"prefill failed: {e.details()}")
        prefill_back = start_sent = now()
        stream = decode.stub.Start(
            pb.StartRequest(request_id=rid, first_token=done.first_token),
            timeout=self.config.stream_timeout_s,
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
                    yield pb.GenerateResponse(request_id=rid, token_ids=chunk.token_ids)
                if chunk.finished:
                    end, end_wall = time.monotonic(), now()
                    timings = pb.Timings(
                        queue_s=queued - arrival.at,
                        prefill_s=done.prefill_s,
                        transfer_s=done.transfer_s,
                        ttft_s=(first_at or end) - arrival.at,
                        tpot_s=chunk.tpot_s,
                        e2e_s=end - arrival.at,
                        prefill_worker=done.worker_id,
                        decode_worker=reserved.worker_id,
                        arrival_unix=arrival.at_wall,
                        end_unix=end_wall,
                    )
                    self._observe(timings, done, chunk, len(tokens))
                    marks = (prefill_sent, prefill_back, start_sent, end_wall)
                    trace = hops(marks, spans_from_proto(done.spans), spans_from_proto(chunk.spans))
                    yield pb.GenerateResponse(
                        request_id=rid,
                        finished=True,
                        finish_reason=chunk.finish_reason,
                        timings=timings,
                        text=self.tokenizer.decode(tokens) if self.tokenizer is not None else "",
                        trace=[
                            *spans_to_proto(spans),
                            *done.spans,
                            *chunk.spans,
                            *spans_to_proto(trace),
                        ],
                        prompt_tokens=len(prompt),
                    )
                    return
        except grpc.RpcError as e:
            if context.is_active():
                context.abort(_to_client(e.code()), f"decode failed: {e.details()}")
        finally:
            self._forget(rid, entry)

    def _pause(self, pause: float) -> float:
        """Back off between tries: many waiting requests polling every 10 ms kept the
        workers' CPUs busy answering Reserve (seen in the capacity sweep on 2 cores)."""
        time.sleep(pause)
        return min(self.config.reserve_retry_s[1], pause * 2)

    def _await_workers(self, deadline: float, context) -> None:
        """Until at least one prefill and one decode worker are registered."""
        pause = self.config.reserve_retry_s[0]
        while reason := self.registry.not_ready():
            if time.monotonic() > deadline or not context.is_active():
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{reason} (waited {self.config.queue_timeout_s}s)",
                )
            pause = self._pause(pause)

    def _reserve(self, arrival: Arrival, deadline: float, context, spans: list[Span]):
        """Reserve blocks on the decode worker with the most headroom; records router.queue
        (arrival -> the call that succeeded) and decode.reserve (that call)."""
        pause = self.config.reserve_retry_s[0]
        while True:
            tried: set[str] = set()
            while (worker := self.registry.pick_decode(tried)) is not None:
                tried.add(worker.worker_id)
                asked = now()
                try:
                    reply = worker.stub.Reserve(
                        pb.ReserveRequest(
                            request_id=arrival.request_id,
                            prompt_token_ids=arrival.prompt,
                            sampling=arrival.sampling,
                            lease_s=self.config.lease_s,
                        ),
                        timeout=self.config.reserve_rpc_timeout_s,
                    )
                except grpc.RpcError as e:
                    self.registry.not_reserved(worker)
                    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.details())
                    if e.code() in _INTERNAL_REFUSALS:
                        context.abort(
                            grpc.StatusCode.UNAVAILABLE,
                            f"decode worker {worker.worker_id} refused the router's "
                            f"credentials ({e.code().name}): is the cluster secret the same?",
                        )
                    if e.code() in (
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.UNAVAILABLE,
                    ):
                        # no answer in time, or none at all: the next worker, and this one
                        # gets nothing new until it heartbeats again (a frozen worker got
                        # request after request, each failing after the timeout)
                        self.registry.suspect(worker)
                    continue  # any other refusal: the next worker (never an untyped error)
                self.registry.reserved(worker, reply.headroom_cost_blocks)
                spans.append(Span("router.queue", arrival.at_wall, asked, "router"))
                spans.append(Span("decode.reserve", asked, now(), worker.worker_id))
                return worker, reply
            if time.monotonic() > deadline or not context.is_active():
                if not self.registry.alive("decode"):
                    context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is registered")
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no decode worker had room for {len(arrival.prompt)} prompt tokens within "
                    f"{self.config.queue_timeout_s}s",
                )
            pause = self._pause(pause)

    def _observe(self, timings: pb.Timings, done, chunk, generated: int) -> None:
        m = self.metrics
        m.queue.observe(timings.queue_s)
        m.ttft.observe(timings.ttft_s)
        m.e2e.observe(timings.e2e_s)
        m.transfer.observe(timings.transfer_s)
        m.transfer_bytes.inc(done.transfer_bytes)
        if generated > 1:
            m.tpot.observe(timings.tpot_s)

    def _forget(self, request_id: str, entry: Inflight) -> Inflight | None:
        """Removes `entry` (or, given None, whatever the id maps to) -> what was removed."""
        with self._lock:
            current = self.inflight.get(request_id)
            if current is None or (entry is not None and current is not entry):
                return None
            del self.inflight[request_id]
            return current

    def release(self, request_id: str, entry: Inflight | None = None) -> bool:
        """Ends the request on its decode worker -> whether it was in flight."""
        removed = self._forget(request_id, entry)
        if removed is not None:
            # if the worker is gone, its lease returns the blocks
            with contextlib.suppress(grpc.RpcError):
                removed.worker.stub.Release(
                    pb.AbortRequest(request_id=request_id),
                    timeout=self.config.release_rpc_timeout_s,
                )
        return removed is not None
