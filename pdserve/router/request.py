"""One request as its client sees it, across the attempts the router makes for it: how it
arrived, what has been sent so far, why an attempt ended early, and its final message.

    Arrival        the validated request as it came in
    RecentIds      ids that ended lately: a new request under one gets its own workers' id
    Run            the tokens the client has been sent, the resumes, the router's spans
    Failure        why an attempt ended early (resumed if attempts are left)
    Finished       what the attempt that finished brings to the final message
    final_message  the last message: finish reason, timings, text and every span
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from pdserve.rpc import pdserve_pb2 as pb
from pdserve.serving.convert import spans_from_proto, spans_to_proto
from pdserve.tokenizer import Tokenizer
from pdserve.trace import Span, hops, now


@dataclass(frozen=True)
class Arrival:
    request_id: str
    prompt: list[int]
    sampling: pb.SamplingParams
    at: float  # time.monotonic()
    at_wall: float  # time.time()
    continued: tuple[int, ...] = ()  # tokens the client already had (GenerateRequest.continuation)
    # the workers' id for the first attempt when it is not the request id: a continued
    # request's (the router that died may have left a reservation under the request id)
    worker_id: str = ""


# how long an ended request's id is remembered: longer than its workers take to let go of it
# (a release is retried for a while; an abort end on a feed is a step away)
REUSE_WINDOW_S = 120.0


class RecentIds:
    """Request ids that ended lately. A client may send a new request under the id of one
    it just cancelled: the workers may still hold the old one under that id for a moment
    (its release on the way, its abort end on the feed), which the new one must not be
    taken for. Such a request gets its own workers' id (`worker_id`)."""

    def __init__(self, keep_s: float = REUSE_WINDOW_S, clock=time.monotonic) -> None:
        self.keep_s = keep_s
        self.clock = clock
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def ended(self, request_id: str) -> None:
        with self._lock:
            self._ended.pop(request_id, None)
            self._ended[request_id] = self.clock()

    def worker_id(self, request_id: str, continued: bool) -> str:
        """The workers' id of a new request's first attempt: "" (its own id) unless it was
        used lately or continues one a router that died served (which may have left a
        reservation under it): then the id with a random tag."""
        t = self.clock()
        with self._lock:
            while self._ended and t - next(iter(self._ended.values())) > self.keep_s:
                self._ended.popitem(last=False)
            reused = request_id in self._ended
        if not (reused or continued):
            return ""
        return f"{request_id}~{'c' if continued else 'u'}{secrets.token_hex(4)}"

    def __len__(self) -> int:
        return len(self._ended)


@dataclass(frozen=True)
class Failure:
    code: grpc.StatusCode
    details: str
    stage: str  # "prefill" | "decode" | "router"


@dataclass(frozen=True)
class Finished:
    prefill: pb.PrefillResponse
    chunk: pb.TokenChunk  # the decode stream's final chunk
    marks: tuple[float, float, float, float]  # trace.hops: Prefill sent/back, Start sent, end
    decode_worker: str


@dataclass
class Run:
    arrival: Arrival
    tokens: list[int] = field(default_factory=list)  # sent to the client, in order
    resumes: int = 0
    migrations: int = 0  # times its KV moved to another decode worker (router/migrate.py)
    first_at: float | None = None  # time.monotonic() of the first token sent
    spans: list[Span] = field(default_factory=list)  # router.queue, decode.reserve, resume
    failed_at: float | None = None  # wall clock of the last failure, for router.resume
    queued_s: float = 0.0  # arrival -> the first attempt's reservation

    @property
    def worker_request_id(self) -> str:
        """The workers' id for this attempt: every resumed one has its own."""
        rid = self.arrival.worker_id or self.arrival.request_id
        return rid if self.resumes == 0 else f"{rid}~r{self.resumes}"

    @property
    def context(self) -> list[int]:
        """What the next attempt prefills: the prompt and every token sent."""
        return self.arrival.prompt + self.tokens

    def remaining(self) -> pb.SamplingParams:
        """The sampling parameters of the next attempt: max_tokens less what was sent."""
        sampling = pb.SamplingParams()
        sampling.CopyFrom(self.arrival.sampling)
        sampling.max_tokens = self.arrival.sampling.max_tokens - len(self.tokens)
        return sampling

    def done(self) -> str:
        """The finish reason when the tokens sent already end the request (the stream broke
        after its last token, before its final message), else ""."""
        if self.tokens and self.tokens[-1] in self.arrival.sampling.stop_token_ids:
            return "stop"
        return "length" if len(self.tokens) >= self.arrival.sampling.max_tokens else ""

    def sent(self, token_ids) -> None:
        self.tokens.extend(token_ids)
        if self.first_at is None:
            self.first_at = time.monotonic()
        if self.failed_at is not None:  # the first tokens after a resume
            self.spans.append(Span("router.resume", self.failed_at, now(), "router"))
            self.failed_at = None


def _span_s(spans, name: str) -> float:
    """The duration of the first span called `name` (proto spans), 0 when there is none."""
    return next((s.end - s.start for s in spans if s.name == name), 0.0)


def final_message(
    run: Run, reason: str, finished: Finished | None, tokenizer: Tokenizer | None
) -> pb.GenerateResponse:
    """`finished`: the attempt that finished (None when none did: an abort between
    attempts, or a stream that broke after its last token)."""
    arrival = run.arrival
    end, end_wall = time.monotonic(), now()
    n = len(run.tokens) - len(arrival.continued)  # this router's
    first = run.first_at or end
    client_tpot = (end - first) / max(1, n - 1)  # the client's, across every attempt
    worker_spans: list = []
    if finished is not None:
        done, chunk = finished.prefill, finished.chunk
        timings = pb.Timings(
            queue_s=run.queued_s,
            # a prompt its decode worker computed (conditional disaggregation): its span there
            # (in the run's spans when the request moved to another decode worker since)
            prefill_s=done.prefill_s or _span_s([*chunk.spans, *run.spans], "decode.prefill"),
            transfer_s=done.transfer_s,
            # the decode worker's own unless resumed or moved
            tpot_s=chunk.tpot_s if run.resumes == 0 and run.migrations == 0 else client_tpot,
            prefill_worker=done.worker_id,
            decode_worker=finished.decode_worker,
        )
        trace = hops(finished.marks, spans_from_proto(done.spans), spans_from_proto(chunk.spans))
        worker_spans = [*done.spans, *chunk.spans, *spans_to_proto(trace)]
    else:
        timings = pb.Timings(tpot_s=client_tpot)
    timings.ttft_s = first - arrival.at
    timings.e2e_s = end - arrival.at
    timings.arrival_unix = arrival.at_wall
    timings.end_unix = end_wall
    timings.resumes = run.resumes
    timings.migrations = run.migrations
    return pb.GenerateResponse(
        request_id=arrival.request_id,
        finished=True,
        finish_reason=reason,
        timings=timings,
        text=tokenizer.decode(run.tokens) if tokenizer is not None else "",
        trace=[*spans_to_proto(run.spans), *worker_spans],
        prompt_tokens=len(arrival.prompt),
    )
