"""One request's way through the cluster, as the router drives it:

    wait for workers -> decode.Reserve (most projected headroom; while none has room, in
    turn: pdserve/router/line.py) -> prefill.Prefill (fewest queued tokens; KV pushed into
    the reserved blocks, the lease renewed meanwhile) -> decode.Start -> tokens streamed to
    the client -> final message with timings, text and every process's spans

A request that arrives before both roles are registered waits in the queue like one that
waits for room, up to the queue timeout, then fails UNAVAILABLE. Whatever ends the request
early (the client cancels, a call fails), the decode worker is told to release its blocks;
if it is gone, its lease returns them.

Survival: when the decode worker streaming a request dies (its stream fails), goes silent
(pdserve/router/watch.py cancels the stream) or loses the reservation, or when the prefill
fails for any reason a retry can fix, the request is resumed: a new reservation on the
worker with the most room (one that did not answer is suspect: skipped until it heartbeats
again), whose prompt is the original prompt plus every token already sent to the client,
and whose max_tokens is what is left. Its prefill recomputes that context; the first token it
samples is the next token of the client's stream, so no token is lost or repeated. Greedy
requests continue exactly as they would have; a seeded sampled request continues with a
valid sample that is not the one an unbroken run would have drawn. Each resumed attempt uses
its own id on the workers (`ID~rN`), so a frozen worker that wakes up cannot confuse them.
After RouterConfig.max_resumes resumes the request fails UNAVAILABLE (RESOURCE_EXHAUSTED when
the last failure was no room), naming the last failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from pdserve.router.config import RouterConfig
from pdserve.router.feed import RouterFeeds
from pdserve.router.leases import LeaseKeeper
from pdserve.router.line import ReserveLine
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import Worker, WorkerRegistry
from pdserve.router.request import Arrival, Failure, Finished, Run, final_message
from pdserve.router.watch import StreamWatch
from pdserve.rpc import UNPOSTED_KEY
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.serving.convert import spans_from_proto
from pdserve.tokenizer import Tokenizer
from pdserve.trace import Span, now

_Code = grpc.StatusCode
# a worker that refuses the router's own credentials is a deployment fault (a secret or
# certificate that differs between members), not the client's: the client sees UNAVAILABLE
_INTERNAL_REFUSALS = (_Code.UNAUTHENTICATED, _Code.PERMISSION_DENIED)
# failures a retry elsewhere cannot fix: the request itself, or the deployment
_FINAL = (_Code.INVALID_ARGUMENT, _Code.FAILED_PRECONDITION, *_INTERNAL_REFUSALS)
# the worker did not answer (in time, or at all): suspect until it heartbeats again
_SILENT = (_Code.DEADLINE_EXCEEDED, _Code.UNAVAILABLE)
# statuses a client is given as they are when resumes run out (the others: UNAVAILABLE)
_CLIENT_CODES = (_Code.RESOURCE_EXHAUSTED, _Code.UNAVAILABLE)
# a call on a channel the registry closed (the worker re-registered elsewhere, or was
# forgotten) raises ValueError instead of an RpcError
_CALL_ERRORS = (grpc.RpcError, ValueError)
# how often a request waiting its turn for decode room checks its client and its deadline
_TURN_CHECK_S = 0.2
# the push window of a reservation whose decode worker computes the prompt itself (no push
# ever comes; 0 would mean "as long as the lease")
LOCAL_PUSH_WINDOW_S = 0.001


MIGRATED = "migrated"  # a decode stream's end when its request's KV moved to another worker


def destination_fields(reserved: pb.ReserveResponse) -> dict:
    """A Reserve's answer as the `dest_*` fields of the call that writes into its blocks
    (a PrefillRequest, or a MigrateRequest: pdserve/router/migrate.py)."""
    return dict(
        dest_worker_id=reserved.worker_id,
        dest_block_ids=reserved.block_ids,
        dest_cached_blocks=reserved.cached_blocks,
        dest_layout=reserved.layout,
        dest_agent_metadata=reserved.agent_metadata,
        dest_fence=reserved.fence,
        dest_ranks=reserved.ranks,
    )


def _code(e: Exception) -> grpc.StatusCode:
    return e.code() if isinstance(e, grpc.RpcError) else _Code.UNAVAILABLE


def _details(e: Exception) -> str:
    return (e.details() if isinstance(e, grpc.RpcError) else str(e)) or ""


def _unposted(e: Exception) -> bool:
    """A prefill worker's word that no WRITE of the request was ever posted (its
    UNPOSTED_KEY trailer, prefill/service.py): its reserved blocks can be freed unfenced."""
    if not isinstance(e, grpc.RpcError):
        return False
    return any(key == UNPOSTED_KEY for key, _ in e.trailing_metadata() or ())


def _under_way(run: Run) -> bool:
    """Whether the request's client already holds tokens or it was resumed after a fault."""
    return bool(run.tokens or run.resumes)


def _to_client(code: grpc.StatusCode) -> grpc.StatusCode:
    return _Code.UNAVAILABLE if code in _INTERNAL_REFUSALS else code


@dataclass(eq=False)
class Inflight:
    """One request's entry in the in-flight table: the decode worker serving it now and
    that worker's id for it (both change when it is resumed). Compared by identity: a
    request that ended and a later one that reuses its id are different entries, so the
    first one's late release cannot touch the second."""

    worker: Worker | None = None
    worker_request_id: str = ""
    released: bool = False  # aborted or cancelled: never resumed
    call: grpc.Future | None = None  # the Prefill call on its way, cancelled on release
    run: Run | None = None  # what the client has been sent (a migration reads it)
    handover: Handover | None = None  # a live KV move under way (pdserve/router/migrate.py)
    streaming: bool = False  # its decode stream runs: the request may be moved
    # its decode worker computes the prompt (no push is ever posted: a release needs no fence)
    prefill_here: bool = False


@dataclass(eq=False)
class Handover:
    """A move of a streaming request to `dest`, reserved there as `request_id` for the
    context the client had been sent when `sent` tokens were (all but the last of them):
    "moving" until the old worker's stream ends "migrated" (the stream takes it: "switched";
    or, when the request was aborted meanwhile, releases it: "cancelled") or the mover gives
    up ("abandoned"). The two sides decide under the handoff's lock, so exactly one of them
    owns the destination's reservation."""

    dest: Worker
    request_id: str
    sent: int
    state: str = "moving"
    # set once the stream decided (or the request ended): the mover waits on it
    switched: threading.Event = field(default_factory=threading.Event)

    def start_request(self, run: Run) -> pb.StartRequest:
        """The destination's Start: the tokens after its reserved context whose KV moved in
        too, and the client's last token as its first (already sent: not streamed again)."""
        tokens = run.tokens
        return pb.StartRequest(
            request_id=self.request_id,
            first_token=tokens[-1],
            more_token_ids=tokens[self.sent - 1 : -1],
            first_token_sent=True,
        )


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
        self._lock = threading.Lock()  # every check-and-change of `inflight` and entries
        self.leases = LeaseKeeper(config.lease_s, skip=lambda w: w.suspect or registry.silent(w))
        self.watch = StreamWatch(registry, config.heartbeat_s)
        self.feeds = RouterFeeds(config.token_feed)  # decode tokens, a message a step
        self.line = ReserveLine()  # requests waiting for decode room, in turn

    @property
    def lock(self) -> threading.Lock:
        """Every check-and-change of the in-flight table and its entries (a migration's
        too: pdserve/router/migrate.py)."""
        return self._lock

    def close(self) -> None:
        self.leases.close()
        self.watch.close()
        self.feeds.close()

    # -- one request ----------------------------------------------------------------------
    def serve(self, arrival: Arrival, context) -> Iterator[pb.GenerateResponse]:
        rid = arrival.request_id
        run = Run(arrival, tokens=list(arrival.continued))
        if reason := run.done():  # a continuation with nothing left to generate
            yield self._final(run, reason, None)
            return
        entry = Inflight(run=run)
        self._await_workers(arrival.at + self.config.queue_timeout_s, context)
        with self._lock:
            self.inflight[rid] = entry
        context.add_callback(lambda: self.release(rid, entry))
        try:
            while True:
                if entry.released:  # aborted between attempts
                    if context.is_active():
                        yield self._final(run, "abort", None)
                    return
                if reason := run.done():  # the stream broke after its last token
                    yield self._final(run, reason, None)
                    return
                failure = yield from self._attempt(run, entry, context)
                if failure is None or not context.is_active():
                    return
                if entry.released:
                    continue
                if run.resumes >= self.config.max_resumes:
                    # what the workers said is theirs (NOT_FOUND, ABORTED, ...): the client
                    # is told no worker could serve it now
                    code = failure.code if failure.code in _CLIENT_CODES else _Code.UNAVAILABLE
                    context.abort(
                        code,
                        f"{failure.stage} failed: {failure.details} (after {run.resumes} resumes)",
                    )
                self.metrics.resumes.labels(failure.stage).inc()
                run.resumes += 1
                run.failed_at = now()
        finally:
            self._forget(rid, entry)

    def _attempt(self, run: Run, entry: Inflight, context):
        """Reserve, prefill, start and stream once -> None when the request ended (its
        final message sent, or the client gone), else the Failure to resume from."""
        rid = run.worker_request_id
        prompt = run.context
        sampling = run.remaining()
        started = time.monotonic()
        got = self._reserve(
            rid, prompt, sampling, started + self._room_wait_s(run), context, run, entry
        )
        if got is None:  # aborted while waiting for room
            return Failure(_Code.CANCELLED, "aborted", "router")
        decode, reserved, asked = got
        with self._lock:
            if entry.released:  # aborted while we reserved
                self.release_later(decode, rid, unpushed=True)
                return Failure(_Code.CANCELLED, "aborted", "router")
            entry.worker, entry.worker_request_id = decode, rid
            entry.prefill_here = self._prefill_here(prompt)
        if entry.prefill_here:
            self.metrics.local_prefills.inc()
            here = pb.PrefillResponse(worker_id=decode.worker_id)
            return (yield from self._stream(run, entry, context, decode, here, now(), here=True))
        lease = self.leases.hold(decode, rid, reserved.fence)
        # a prefill worker is waited for queue_timeout_s (from the attempt's start; from
        # now for one under way, which may have waited longer for room)
        waiting_from = time.monotonic() if _under_way(run) else started
        prefill = self._pick_prefill(
            len(prompt), waiting_from + self.config.queue_timeout_s, context, entry
        )
        if prefill is None:
            self.leases.drop(lease)
            self._release_attempt(entry, unpushed=True)
            if not context.is_active():
                return None
            if entry.released:
                return Failure(_Code.CANCELLED, "aborted", "router")
            why = "is registered" if not self.registry.alive("prefill") else "answers"
            context.abort(_Code.UNAVAILABLE, f"no prefill worker {why}")
        prefill_sent = now()
        # inside the push window the decode worker fences for, less what the Reserve took
        budget = self.config.prefill_timeout_s - (time.monotonic() - asked)
        watched = []
        try:
            call = prefill.stub.Prefill.future(
                pb.PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    **destination_fields(reserved),
                ),
                timeout=max(0.001, budget),
            )
            with self._lock:
                entry.call = call  # an abort or a client gone cancels it
                cancelled = entry.released
            if cancelled:
                call.cancel()
            # either worker going silent meanwhile ends the wait (the watch cancels the call)
            watched = [self.watch.add(decode, call), self.watch.add(prefill, call)]
            try:
                done = call.result()
            finally:
                for w in watched:
                    self.watch.remove(w)
        except (*_CALL_ERRORS, grpc.FutureCancelledError) as e:
            # a cancelled call raises FutureCancelledError, which is no RpcError
            if lost := [w.worker for w in watched if w.lost]:
                self._release_attempt(entry)
                return Failure(
                    _Code.UNAVAILABLE,
                    f"{lost[0].record.role} worker {lost[0].worker_id} stopped heartbeating",
                    "prefill",
                )
            if isinstance(e, grpc.FutureCancelledError):  # aborted, or the client left
                self._release_attempt(entry)
                return Failure(_Code.CANCELLED, "aborted", "router")
            code = _code(e)
            # refused before anything was queued, or failed with nothing posted: no push
            # can land, no fence needed
            self._release_attempt(entry, unpushed=code in _FINAL or _unposted(e))
            if code in _FINAL or not context.is_active():
                context.abort(_to_client(code), f"prefill failed: {_details(e)}")
            if code in _SILENT:
                self.registry.suspect(prefill)
            return Failure(code, _details(e), "prefill")
        finally:
            self.leases.drop(lease)
            with self._lock:
                entry.call = None
        return (yield from self._stream(run, entry, context, decode, done, prefill_sent))

    def _stream(
        self, run: Run, entry: Inflight, context, decode: Worker, done, prefill_sent, here=False
    ):
        """Start on the decode worker and relay its tokens; when its stream ends "migrated"
        (the request's KV moved, pdserve/router/migrate.py), on the worker it moved to.
        `here`: no prefill ran, the decode worker computes the prompt itself."""
        prefill_back = start_sent = now()
        if entry.released:  # aborted while its prefill ran
            return Failure(_Code.CANCELLED, "aborted", "router")
        start = pb.StartRequest(
            request_id=entry.worker_request_id, first_token=done.first_token, prefill_here=here
        )
        while True:
            marks = (prefill_sent, prefill_back, start_sent)
            result = yield from self._relay(run, entry, context, decode, done, marks, start)
            if not isinstance(result, Handover):
                return result
            decode, start, start_sent = result.dest, result.start_request(run), now()
            run.migrations += 1

    def _relay(self, run: Run, entry: Inflight, context, decode: Worker, done, marks, start):
        """One decode stream -> None (the request ended), the Failure to resume from, or the
        Handover to go on with (the stream ended "migrated")."""
        rid = run.arrival.request_id
        # its tokens on the worker's feed (a message a step for every stream) when it has one
        sub = self.feeds.subscribe(decode, start.request_id)
        start.feed_id = "" if sub is None else sub.feed_id
        try:
            stream = decode.stub.Start(start, timeout=self.config.stream_timeout_s)
        except ValueError as e:  # its channel was closed: the worker is gone
            if sub is not None:
                sub.close()
            self._release_attempt(entry)
            return Failure(_Code.UNAVAILABLE, str(e), "decode")
        context.add_callback(stream.cancel)
        watched = self.watch.add(decode, stream)
        switched_at = time.monotonic() if start.first_token_sent else None
        entry.streaming = True
        chunks = stream if sub is None else sub.chunks(stream, self.config.stream_timeout_s)
        try:
            for chunk in chunks:
                if chunk.token_ids:
                    if switched_at is not None:
                        self.metrics.switch.observe(time.monotonic() - switched_at)
                        switched_at = None
                    run.sent(chunk.token_ids)
                if chunk.finished and chunk.finish_reason == MIGRATED:
                    run.spans.extend(spans_from_proto(chunk.spans))
                    moved = self._switch(entry)
                    if moved is not None:
                        return moved
                    failure = Failure(_Code.UNAVAILABLE, "moved, to no destination", "decode")
                    break
                if chunk.finished:
                    # the last tokens travel with the end, as they came: a client never
                    # holds an end-of-sequence token without knowing the request is over
                    finished = Finished(done, chunk, (*marks, now()), decode.worker_id)
                    final = self._final(run, chunk.finish_reason, finished)
                    final.token_ids.extend(chunk.token_ids)
                    yield final
                    return None
                if chunk.token_ids:
                    yield pb.GenerateResponse(request_id=rid, token_ids=chunk.token_ids)
            else:
                failure = Failure(
                    _Code.UNKNOWN, "the stream ended without its final message", "decode"
                )
        except grpc.RpcError as e:
            if not context.is_active():
                return None
            if entry.released:
                return Failure(_Code.CANCELLED, "aborted", "decode")
            if watched.lost:
                failure = Failure(
                    _Code.UNAVAILABLE,
                    f"decode worker {decode.worker_id} stopped heartbeating",
                    "decode",
                )
            else:
                failure = Failure(e.code(), e.details() or "", "decode")
        finally:
            entry.streaming = False
            self.watch.remove(watched)
            if sub is not None:
                sub.close()
            with self._lock:
                pending = entry.handover
            if pending is not None:  # a move this stream will not take now: its mover
                pending.switched.set()  # decides at once (it waited migrate_timeout_s)
        if failure.code in _FINAL:
            self._release_attempt(entry)
            context.abort(_to_client(failure.code), f"decode failed: {failure.details}")
        if failure.code in _SILENT:
            self.registry.suspect(decode)
        self._release_attempt(entry)
        return failure

    def _switch(self, entry: Inflight) -> Handover | None:
        """The old worker's stream ended "migrated": take the move's destination (None when
        there is none, or its mover gave up: then the request resumes by recompute)."""
        with self._lock:
            moved, entry.handover = entry.handover, None
            if moved is None or moved.state != "moving":
                return None
            if entry.released:  # aborted while it moved: its new blocks go back at once
                moved.state = "cancelled"
                moved.switched.set()
                self.release_later(moved.dest, moved.request_id)
                return None
            moved.state = "switched"
            moved.switched.set()
            entry.worker, entry.worker_request_id = moved.dest, moved.request_id
            entry.prefill_here = False  # its KV was pushed into the destination's blocks
            return moved

    def _final(self, run: Run, reason: str, finished: Finished | None) -> pb.GenerateResponse:
        msg = final_message(run, reason, finished, self.tokenizer)
        if finished is not None:
            self.line.kick()  # its decode worker freed its blocks
        m, t = self.metrics, msg.timings
        m.ttft.observe(t.ttft_s)
        m.e2e.observe(t.e2e_s)
        if finished is not None:
            m.queue.observe(t.queue_s)
            if finished.prefill.transfer_bytes:  # else computed on a decode worker: no push
                m.transfer.observe(t.transfer_s)
            m.transfer_bytes.inc(finished.prefill.transfer_bytes)
            if len(run.tokens) > 1:
                m.tpot.observe(t.tpot_s)
        return msg

    # -- waiting and reserving -----------------------------------------------------------
    def _prefill_here(self, context: list[int]) -> bool:
        """Whether the decode worker that reserves `context` computes it too, beside its
        running batch (conditional disaggregation): short enough, no prefill worker."""
        limit = self.config.local_prefill_tokens
        return limit > 0 and len(context) <= limit

    def _pause(self, pause: float) -> float:
        """Back off between tries: many waiting requests polling every 10 ms kept the
        workers' CPUs busy answering Reserve (seen in the capacity sweep on 2 cores)."""
        time.sleep(pause)
        return min(self.config.reserve_retry_s[1], pause * 2)

    def _room_wait_s(self, run: Run) -> float:
        """This attempt's wait for room: longer once the client holds tokens or the
        request was resumed (RouterConfig.room_wait_s)."""
        return self.config.room_wait_s(_under_way(run))

    def _await_workers(self, deadline: float, context) -> None:
        """Until at least one prefill and one decode worker are registered."""
        pause = self.config.reserve_retry_s[0]
        while reason := self.registry.not_ready():
            if time.monotonic() > deadline or not context.is_active():
                context.abort(
                    _Code.UNAVAILABLE,
                    f"{reason} (waited {self.config.queue_timeout_s}s)",
                )
            pause = self._pause(pause)

    def _pick_prefill(
        self, prompt_tokens: int, deadline: float, context, entry: Inflight
    ) -> Worker | None:
        """The prefill worker to use, waiting while every one is suspect (it did not answer
        a call: until its next heartbeat) -> None at the deadline, or when the client left
        or aborted."""
        pause = self.config.reserve_retry_s[0]
        while (worker := self.registry.pick_prefill(prompt_tokens)) is None:
            if time.monotonic() > deadline or not context.is_active() or entry.released:
                return None
            pause = self._pause(pause)
        return worker

    def _reserve(
        self, rid: str, prompt: list[int], sampling, deadline: float, context, run: Run, entry
    ):
        """Reserve blocks on the decode worker with the most headroom, in turn: the request
        waits in the line (pdserve/router/line.py; a resumed one ahead of new ones) and,
        once someone has been refused everywhere, asks only at its head -> (worker, answer,
        time.monotonic() when the successful call was sent), None when the request was
        aborted meanwhile. The first attempt records
        router.queue (arrival -> that call) and decode.reserve (the call)."""
        ticket = self.line.join(front=run.resumes > 0)
        try:
            return self._reserve_in_line(
                ticket, rid, prompt, sampling, deadline, context, run, entry
            )
        finally:
            self.line.leave(ticket)

    def _reserve_in_line(self, ticket, rid, prompt, sampling, deadline, context, run, entry):
        first, longest = self.config.reserve_retry_s
        pause = first
        while True:
            if entry.released:
                return None
            if time.monotonic() > deadline or not context.is_active():
                if not self.registry.alive("decode"):
                    context.abort(_Code.UNAVAILABLE, "no decode worker is registered")
                context.abort(
                    _Code.RESOURCE_EXHAUSTED,
                    f"no decode worker had room for {len(prompt)} prompt tokens within "
                    f"{self._room_wait_s(run):g}s",
                )
            if not self.line.wait_turn(ticket, _TURN_CHECK_S):
                continue  # not the head yet: check the client and the deadline again
            self.line.asking(ticket)
            if got := self._ask_each_worker(rid, prompt, sampling, context, run):
                return got
            # every worker refused: from now on the line goes in turn; ask again when room
            # may have come back (a request ended, blocks were released, a worker
            # heartbeat), at the latest after the pause
            self.line.refused()
            kicked = self.line.wait_room(ticket, pause)
            pause = first if kicked else min(longest, pause * 2)

    def _ask_each_worker(self, rid, prompt, sampling, context, run):
        """One Reserve per live decode worker, the most headroom first -> the first
        (worker, answer, sent) that reserved, None when every one refused."""
        tried: set[str] = set()
        # the line as it stands (this request in it): cost-aware admission admits past its
        # expected peak only while no more than one request waits per decode worker
        line, decode_workers = len(self.line), len(self.registry.routable("decode"))
        while (worker := self.registry.pick_decode(tried)) is not None:
            tried.add(worker.worker_id)
            asked, asked_wall = time.monotonic(), now()
            try:
                reply = worker.stub.Reserve(
                    pb.ReserveRequest(
                        request_id=rid,
                        prompt_token_ids=prompt,
                        sampling=sampling,
                        lease_s=self.config.lease_s,
                        # no push will come when it computes the prompt itself: a
                        # reservation whose Start never comes (this router died) is not
                        # fenced for a push window after its lease
                        push_window_s=(
                            LOCAL_PUSH_WINDOW_S
                            if self._prefill_here(prompt)
                            else self.config.push_window_s
                        ),
                        line=line,
                        decode_workers=decode_workers,
                        # a resumed request's prompt ends with every token it sent: its
                        # output counts from its start
                        generated_tokens=len(run.tokens),
                    ),
                    timeout=self.config.reserve_rpc_timeout_s,
                )
            except _CALL_ERRORS as e:
                self.registry.not_reserved(worker)
                code = _code(e)
                if code == _Code.INVALID_ARGUMENT:
                    context.abort(_Code.INVALID_ARGUMENT, _details(e))
                if code in _INTERNAL_REFUSALS:
                    context.abort(
                        _Code.UNAVAILABLE,
                        f"decode worker {worker.worker_id} refused the router's "
                        f"credentials ({code.name}): is the cluster secret the same?",
                    )
                if code in _SILENT:
                    # no answer in time, or none at all: the next worker, and this one
                    # gets nothing new until it heartbeats again (a frozen worker got
                    # request after request, each failing after the timeout)
                    self.registry.suspect(worker)
                continue  # any other refusal: the next worker (never an untyped error)
            self.registry.reserved(worker, reply.headroom_cost_blocks)
            if run.resumes == 0:
                run.queued_s = time.monotonic() - run.arrival.at
                run.spans.append(Span("router.queue", run.arrival.at_wall, asked_wall, "router"))
                run.spans.append(Span("decode.reserve", asked_wall, now(), worker.worker_id))
            return worker, reply, asked
        return None

    # -- releasing --------------------------------------------------------------------------
    def release_later(self, worker: Worker, worker_request_id: str, unpushed: bool = False):
        """Tell `worker` to release, without waiting for its answer: a frozen worker must
        not hold up the request (if it is gone, its lease returns the blocks), nor the
        releases to other workers (a pool of 8 threads did: each call to a frozen worker
        held one for its whole timeout, and a healthy worker's releases queued behind)."""

        def answered(outcome) -> None:
            try:
                outcome.result()
            except grpc.FutureCancelledError:  # its channel closed: the worker left
                pass
            except _CALL_ERRORS as e:
                if _code(e) in _SILENT:
                    self.registry.suspect(worker)
            finally:
                self.line.kick()  # its blocks are free (or its lease will free them)

        try:
            if worker.stub is None:  # no channel to it any more
                raise ValueError("no channel")
            call = worker.stub.Release.future(
                pb.AbortRequest(request_id=worker_request_id, unpushed=unpushed),
                timeout=self.config.release_rpc_timeout_s,
            )
        except ValueError:  # a call on a closed channel: the worker re-registered or left
            self.line.kick()
            return
        call.add_done_callback(answered)

    def _release_attempt(self, entry: Inflight, unpushed: bool = False) -> None:
        """The attempt in `entry` ended early: release it on its worker."""
        with self._lock:
            worker, wrid = entry.worker, entry.worker_request_id
            entry.worker, entry.worker_request_id = None, ""
            unpushed = unpushed or entry.prefill_here
        if worker is not None:
            self.release_later(worker, wrid, unpushed)

    def _forget(self, request_id: str, entry: Inflight) -> Inflight | None:
        """Removes `entry` from the in-flight table -> it, when it was there."""
        with self._lock:
            current = self.inflight.get(request_id)
            if current is None or current is not entry:
                return None
            del self.inflight[request_id]
            return current

    def release(self, request_id: str, entry: Inflight) -> bool:
        """Ends the request (an abort, or the client went away) -> whether it was in
        flight. Its current attempt is released on its decode worker, and it is never
        resumed."""
        removed = self._forget(request_id, entry)
        if removed is None:
            return False
        with self._lock:
            removed.released = True
            worker, wrid, call = removed.worker, removed.worker_request_id, removed.call
            unpushed = removed.prefill_here
            if removed.handover is not None:  # its stream will not switch: the mover decides
                removed.handover.switched.set()
        if call is not None:
            call.cancel()
        if worker is not None:
            # from the release threads: this runs in gRPC's callback of a finished call,
            # where a frozen worker's Release would hold up the server (if the worker is
            # gone, its lease returns the blocks)
            self.release_later(worker, wrid, unpushed)
        return True
