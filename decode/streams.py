"""A decode request's token stream: typed events from the step loop to the gRPC stream, and
the spans it records for the request's trace.

    TokenEvent(token)       one new token
    EndEvent(reason, last)  the last event: "stop" | "length" | "abort", with the request's
                            last token when the step that made it also ended the request
                            (one message on the wire: a stream cut between the two would
                            leave the router unable to tell that the request was over)

A stream bound to a feed (decode/feed.py) hands its events to the feed instead; its Start
call hears of its end from the feed's sender once the message that carried it is sent (or
a BrokenEvent when its message could not be built).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.trace import Span, now

if TYPE_CHECKING:
    from decode.feed import Feed


# a request's first STEP_SPANS steps are a decode.step span each; later ones fold into one
# decode.steps span per run of steps (a preemption starts a new run): a final message's trace
# stays under ~20 KB however long the output (a span a step was ~55 bytes a token: 0.5 MB for
# 10k tokens, held by the router for every request it streams, past gRPC's 4 MiB at ~75k)
STEP_SPANS = 256


@dataclass(frozen=True)
class TokenEvent:
    token: int


@dataclass(frozen=True)
class EndEvent:
    finish_reason: str
    last_token: int | None = None


@dataclass(frozen=True)
class BrokenEvent:
    """(A stream on a feed.) Its message could not be built: its Start call fails instead
    (a retry, a resume, can help); the feed goes on for every other stream."""

    reason: str


StreamEvent = TokenEvent | EndEvent | BrokenEvent


@dataclass
class Stream:
    worker: str
    events: queue.Queue[StreamEvent] = field(default_factory=queue.Queue)
    last_token: float = field(default_factory=time.monotonic)
    first_token: float | None = None  # time.monotonic() when the first token was handed over
    # its prompt is computed here (conditional disaggregation): its first token is sampled
    # here too, and a decode.prefill span marks first step -> first token
    prefill_here: bool = False
    # trace (wall clock): Start received, first step, pending preemption, finished spans
    received: float = field(default_factory=now)
    first_step: float | None = None
    preempted_at: float | None = None
    spans: list[Span] = field(default_factory=list)
    # its caller's feed (decode/feed.py), and the request id the feed knows it by
    feed: Feed | None = None
    request_id: str = ""
    produced: int = 0  # tokens handed over, the one sent with the end included
    feed_broken: bool = False  # a message of it could not be built: the rest is dropped
    ended: bool = False
    steps: int = 0  # decode.step spans recorded (at most STEP_SPANS)

    def token(self, token: int) -> float:
        """Hand a token to the stream -> seconds since the previous one."""
        gap = self.token_gap()
        self.produced += 1
        if self.feed is None:
            self.events.put(TokenEvent(token))
        else:
            self.feed.add(self, TokenEvent(token))
        return gap

    def token_gap(self) -> float:
        t = time.monotonic()
        gap, self.last_token = t - self.last_token, t
        if self.first_token is None:
            self.first_token = t
            if self.prefill_here:
                start = self.first_step if self.first_step is not None else self.received
                self.spans.append(Span("decode.prefill", start, now(), self.worker))
        return gap

    def tpot(self, tokens: int) -> float:
        """Mean seconds per token after the first of `tokens` handed over (0 for one)."""
        if tokens < 2 or self.first_token is None:
            return 0.0
        return (self.last_token - self.first_token) / (tokens - 1)

    def stepped(self, start: float, end: float) -> None:
        if self.first_step is None:
            self.first_step = start
            self.spans.append(Span("decode.admission", self.received, start, self.worker))
        if self.preempted_at is not None:
            self.spans.append(Span("decode.preempted", self.preempted_at, start, self.worker))
            self.preempted_at = None
        if self.steps < STEP_SPANS:
            self.steps += 1
            self.spans.append(Span("decode.step", start, end, self.worker))
        elif self.spans[-1].name == "decode.steps":  # the run of folded steps goes on
            self.spans[-1] = Span("decode.steps", self.spans[-1].start, end, self.worker)
        else:  # the first step past the limit, or the first after a preemption
            self.spans.append(Span("decode.steps", start, end, self.worker))

    def end(self, finish_reason: str, last_token: int | None = None) -> None:
        t = now()
        if self.first_step is None:  # done at its first token: never stepped
            self.spans.append(Span("decode.admission", self.received, t, self.worker))
        else:
            self.spans.append(Span("decode.run", self.first_step, t, self.worker))
        if last_token is not None:
            self.token_gap()
            self.produced += 1
        self.ended = True
        event = EndEvent(finish_reason, last_token)
        if self.feed is not None:  # its sender tells the Start once the end is sent
            self.feed.add(self, event)
        else:
            self.events.put(event)
