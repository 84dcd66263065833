"""The decode worker: owns the KV pool that matters, reserves blocks before any prefill,
receives KV from prefill workers over the transfer agent, and decodes with continuous
batching on the engine core.

Block ownership on this side (DESIGN §2):

    FREE -reserve(lease)-> RESERVED -KV pushed + start-> RUNNING -finish/abort-> FREE
                               └────── lease expired / release ───────────────────> FREE

The books are decode/state.py's (RESERVED in its reservations, RUNNING, preempted and
parked in the engine core); this class adds the threads, the data plane and the streams.
One lock guards the books and the streams; the step loop runs on its own thread, holds
the lock to schedule and to account but not while the model runs, and hands tokens to each
request's stream (decode/streams.py), which the gRPC service drains.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from decode.config import DecodeConfig
from decode.feed import Feed, Feeds
from decode.legs import RANK_EXTENSION
from decode.metrics import DecodeMetrics
from decode.migrate import Migrated, MigrationFailed, Migrator
from decode.state import DecodeState, ReservationError, Reserved, UnknownRequest
from decode.streams import Stream
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.engine.core import EngineCore
from pdserve.engine.output import FinishedRequest, StepOutput
from pdserve.engine.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.serving.cpu_lease import open_lease, turn_of
from pdserve.serving.destination import Destination
from pdserve.serving.kv_pool import KVEndpoint, open_endpoint
from pdserve.serving.registration import WorkerStats
from pdserve.trace import Span, now
from transfer import TransferAgent

log = logging.getLogger(__name__)

__all__ = [
    "DecodeWorker",
    "KVNotArrived",
    "MigrationFailed",
    "Migrated",
    "ReservationError",
    "Reserved",
    "UnknownRequest",
]


class KVNotArrived(TimeoutError):
    """The prompt's KV push did not complete in time (UNAVAILABLE at the edge)."""


class DecodeWorker:
    def __init__(self, core: EngineCore, endpoint: KVEndpoint, config: DecodeConfig) -> None:
        self.core = core
        self.endpoint = endpoint
        self.config = config
        self.worker_id = config.worker_id
        self.metrics = DecodeMetrics()
        self.state = DecodeState(core, config)
        self.lock = threading.Lock()  # the state, the core and the streams
        # the transfer agent's calls: a migration's (add a peer, post and poll WRITEs) take
        # it without the lock above, and the step loop only collects notifications when it
        # is free (a first WRITE to a new peer can take 100 ms to connect: never a stall)
        self.agent_lock = threading.Lock()
        self.streams: dict[str, Stream] = {}
        self.feeds = Feeds()  # the routers' feeds: a step's tokens in one message each
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.migrator = Migrator(self)
        self._detaching: dict[str, Future] = {}  # taken out at the next step boundary
        # decode steps of the node's decode workers overlap, each on its part of the CPUs
        self.cpu_lease = open_lease(config.cpu_lease, core.kv_pool.device.type, shared=True)
        self._loop = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        self._loop.start()

    @classmethod
    def build(
        cls, model: str, args: EngineArgs, config: DecodeConfig, agent: TransferAgent
    ) -> DecodeWorker:
        """A decode worker on its own engine, its pool registered with `agent`.

        Without prefix offload every reserved block is fresh and the prefill worker fills
        all of them. With it, blocks keep their prefix hashes here: a new prompt's leading
        full blocks are shared with cached ones (device) or reloaded from the spill tiers
        (offloaded), Reserve says how many, and the prefill worker pushes only the rest; a
        request computed again after a preemption reloads what it had the same way."""
        args = dataclasses.replace(args, enable_prefix_caching=args.prefix_offload)
        core, _ = build_engine(model, args)
        return cls(core, open_endpoint(core, model, agent, RANK_EXTENSION), config)

    @property
    def reservations(self):
        return self.state.reservations

    # -- control plane ----------------------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        lease_s: float = 0.0,
        push_window_s: float = 0.0,
        extra_tokens: int = 0,
        waiting: float | None = None,
        generated: int = 0,
    ) -> Reserved:
        """-> blocks for the prompt's KV (and `extra_tokens` more: a migration's). Raises
        ValueError (bad input) or ReservationError. `waiting`, `generated`:
        DecodeState.reserve's."""
        with self.lock:
            if request_id in self.streams:
                raise ValueError(f"request_id: {request_id!r} is already known here")
            try:
                reserved = self.state.reserve(
                    request_id,
                    prompt,
                    params,
                    lease_s,
                    push_window_s,
                    extra_tokens,
                    waiting,
                    generated,
                )
            except ReservationError:
                self.metrics.refused.inc()
                raise
            self._account()
        self._wake.set()  # the step loop watches its push and lease from now on
        self.config.failpoints.hit("decode.reserve", request_id)
        return reserved

    def renew(self, request_id: str, fence: int, lease_s: float) -> bool:
        """The router keeps a reservation alive while its prefill runs."""
        with self.lock:
            return self.state.renew(request_id, fence, lease_s)

    def start_here(self, request_id: str, feed: Feed | None = None) -> Stream:
        """No prefill worker computes the prompt (conditional disaggregation): the step loop
        computes it in the reserved blocks beside the running batch, and the stream's first
        token is the one it samples then. `feed`: where its events go (decode/feed.py)."""
        with self.lock:
            self.state.start_here(request_id)
            self.metrics.local_prefills.inc()
            stream = Stream(self.worker_id, prefill_here=True, feed=feed, request_id=request_id)
            self.streams[request_id] = stream
        self._wake.set()
        return stream

    def start(
        self,
        request_id: str,
        first_token: int,
        more: list[int] | tuple = (),
        first_token_sent: bool = False,
        feed: Feed | None = None,
    ) -> Stream:
        """The prompt's KV has been pushed: decode from `first_token` on. A migrated request
        (decode/migrate.py) brings `more` tokens whose KV came with the prompt's, and its
        `first_token` was sent to the client by the worker it left: not streamed again."""
        start_wall = now()
        self._await_kv(request_id)
        with self.lock:
            res, done = self.state.start(request_id, first_token, more)
            pushed = len(res.request.block_ids) - res.cached_blocks
            self.metrics.transfer_bytes.labels("received").inc(
                pushed * self.endpoint.bytes_per_block
            )
            self.metrics.transfer_seconds.labels("received").observe(
                time.monotonic() - res.reserved_at
            )
            stream = Stream(self.worker_id, received=start_wall, feed=feed, request_id=request_id)
            self.streams[request_id] = stream
            if done is not None:  # its first token ended it: one message with the end
                self._close(done, last_token=None if first_token_sent else first_token)
            elif not first_token_sent:
                stream.token(first_token)
        if feed is not None:
            feed.flush()
        self._wake.set()
        return stream

    def release(self, request_id: str, unpushed: bool = False) -> bool:
        """Abort: the request's blocks go back to the pool whatever state it is in (a
        reservation whose push may still land: once it cannot, decode/reservations.py)."""
        with self.lock:
            found, done = self.state.release(request_id, unpushed)
            if done is not None:
                self._close(done)
            self._account()
            return found

    def migrate(
        self,
        request_id: str,
        dest: Destination,
        dest_request_id: str,
        max_rounds: int = 0,
        timeout_s: float | None = None,
    ) -> Migrated:
        """Move a running request's KV into `dest` while it decodes, then stop it here: its
        stream ends "migrated" (decode/migrate.py). Raises MigrationFailed (it goes on here)."""
        return self.migrator.move(request_id, dest, dest_request_id, max_rounds, timeout_s)

    def detach(self, request_id: str, timeout_s: float) -> Request | None:
        """Take a running request out of the batch with its blocks at a step boundary (the
        step loop's, when a step is under way) -> it, or None when it is not running by then
        (finished in that step, say). Raises TimeoutError."""
        with self.lock:
            request = self.core.detach(request_id)
            if request is not None or self.core.kv_of(request_id) is None:
                return request
            future = self._detaching.setdefault(request_id, Future())
        self._wake.set()
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            with self.lock:
                if self._detaching.get(request_id) is future:
                    del self._detaching[request_id]
            if future.done():  # detached as the wait ran out: it is ours
                return future.result()
            raise TimeoutError(f"{request_id!r} did not leave a step in {timeout_s}s") from None

    def _detach_waiting(self) -> None:
        """(Under the lock, no step in flight.) The detaches asked for during a step."""
        for request_id, future in self._detaching.items():
            future.set_result(self.core.detach(request_id))
        self._detaching.clear()

    def handed_over(self, request: Request, span: Span) -> None:
        """(Under the lock.) A detached request's KV is at its destination: its blocks come
        back and its stream ends "migrated"."""
        self.core.handed_over(request)
        stream = self.streams.pop(request.request_id, None)
        if stream is not None:
            stream.spans.append(span)
            stream.end("migrated")
        self._account()

    def ended(self, done: FinishedRequest) -> None:
        """(Under the lock.) A request ended outside a step (aborted while its KV moved, and
        the move failed): its stream ends."""
        self._close(done)
        self._account()

    def is_pending(self, request_id: str) -> bool:
        """Whether the engine still holds the request (running, waiting after a preemption,
        or parked in a spill tier): a stream that is silent for a long time while its request
        waits for room is alive, not stuck."""
        with self.lock:
            return self.core.holds(request_id)

    def stats(self) -> WorkerStats:
        """For heartbeats."""
        with self.lock:
            return self.state.stats()

    def check_integrity(self) -> None:
        with self.lock:
            self.state.check_integrity()

    # -- data plane -------------------------------------------------------------------------
    def _await_kv(self, request_id: str) -> None:
        deadline = time.monotonic() + self.config.kv_arrival_timeout_s
        while True:
            with self.lock:
                self._collect_notifications()
                # looked at, not taken: state.start takes it under the same lock as the
                # start, and a release in between still sees the push as arrived (not fenced)
                if self.reservations.arrived(request_id):
                    return
                if request_id not in self.reservations:
                    raise UnknownRequest(f"no reservation for {request_id!r} (expired or released)")
            if time.monotonic() > deadline:
                raise KVNotArrived(
                    f"KV of {request_id!r} did not arrive in {self.config.kv_arrival_timeout_s}s"
                )
            time.sleep(self.config.kv_arrival_poll_s)

    def _collect_notifications(self, wait: bool = True) -> None:
        """Push notifications, for Start and for fenced blocks (under the lock); a tensor
        parallel worker's ranks each receive the parts of a push written into their pools.
        `wait=False` (the step loop): none now when a migration is using the agent."""
        if not self.agent_lock.acquire(blocking=wait):
            return
        try:
            got = self.endpoint.agent.notifications()
            if self.migrator.retiring:  # failed moves' staging, once nothing reads it
                self.metrics.staging_kept.set(self.migrator.retiring.sweep())
        finally:
            self.agent_lock.release()
        notes = [n for per_peer in got.values() for n in per_peer]
        for more in self.core.rank_call("notifications"):
            notes += more
        self.state.note_arrivals(notes)

    def _run(self) -> None:
        """The step loop outlives any one step's failure (logged; the loop waits a moment
        before the next, so that a failure that repeats does not spin)."""
        while not self._stop.is_set():
            try:
                stepped = self._step()
            except Exception:  # noqa: BLE001 - one bad step must not stop every stream
                log.exception("decode step failed")
                stepped = False
            if not stepped:
                self._wake.wait(timeout=self._idle_wait_s())
                self._wake.clear()

    def _idle_wait_s(self) -> float:
        """The step loop's sleep with nothing to run: short while the worker holds anything
        (a reservation's push or lease to watch, a fenced one's push, a request waiting for
        room, moving or parked), long when it holds nothing (a woken idle loop costs a
        notification poll and the books; 20 of them a second were 1.4% of a core here)."""
        with self.lock:
            empty = not len(self.reservations) and not self.reservations.fenced
            empty = empty and self.core.holds_nothing
        return self.config.idle_park_s if empty else self.config.idle_wait_s

    def _step(self) -> bool:
        """One engine step: scheduled and accounted under the lock, run outside it (the plan
        is plain data by then), so Reserve/Start/Release and heartbeats are not starved."""
        core = self.core
        # before a step is planned: a failpoint that raises leaves no step in flight
        self.config.failpoints.hit("decode.step")
        with self.lock:
            self._collect_notifications(wait=False)
            self.state.expire()
            self._detach_waiting()
            plan = core.begin_step()
            if plan is None:
                self._account()
                return False
        with turn_of(self.cpu_lease):  # the step's time starts once it has the CPUs
            step_start = now()
            result = core.run(plan)
            step_end = now()
        try:
            with self.lock:
                out = core.end_step(plan, result)
                self.state.observe_step(plan, step_end - step_start)
                self._deliver(out, step_start, step_end)
        finally:  # what the step handed over goes now, even when a later part failed
            self.feeds.flush()
        return True

    def _deliver(self, out: StepOutput, step_start: float, step_end: float) -> None:
        for rid in out.ran:
            if (stream := self.streams.get(rid)) is not None:
                stream.stepped(step_start, step_end)
        for rid in out.preempted:  # preempted when the step was scheduled
            if (stream := self.streams.get(rid)) is not None:
                stream.preempted_at = step_start
        ending = {done.request_id for done in out.finished}
        last: dict[str, int] = {}
        for new in out.tokens:
            if new.request_id in ending:  # goes out with the end (decode/streams.py)
                last[new.request_id] = new.token
            elif (stream := self.streams.get(new.request_id)) is not None:
                first = stream.first_token is None
                gap = stream.token(new.token)
                if not first:  # the first one (computed here) is no inter-token gap
                    self.metrics.itl.observe(gap)
        for done in out.finished:
            token = last.get(done.request_id)
            stream = self.streams.get(done.request_id)
            if token is not None and stream is not None and stream.first_token is not None:
                self.metrics.itl.observe(time.monotonic() - stream.last_token)
            self._close(done, token)
        self._account()
        self.metrics.account_policy(self.state.admission.inputs)

    def _account(self) -> None:
        """The gauges, after every change of the books (reserve, release, step, expiry):
        they used to move only when a step ran, so an idle worker reported the usage of its
        last step while hundreds of blocks were reserved or freed since."""
        self.metrics.account(self.core.stats(), self.state.reservations)

    def _close(self, done: FinishedRequest, last_token: int | None = None) -> None:
        self.state.observe(done)
        stream = self.streams.pop(done.request_id, None)
        if stream is not None:
            stream.end(done.finish_reason, last_token)

    def close(self) -> None:
        self.feeds.close_all()
        self._stop.set()
        self._wake.set()
        self._loop.join(timeout=5)
        self.endpoint.close()
        self.core.close()
        if self.cpu_lease is not None and not self._loop.is_alive():  # else it may be mid-turn
            self.cpu_lease.close()
