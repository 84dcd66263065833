"""The decode worker: owns the KV pool that matters, reserves blocks before any prefill,
receives KV from prefill workers over the transfer agent, and decodes with continuous
batching.

Block ownership on this side (DESIGN §2):

    FREE -reserve(lease)-> RESERVED -KV pushed + start-> RUNNING -finish/abort-> FREE
                               └────── lease expired / release ───────────────────> FREE

One lock guards the scheduler, the allocator and the reservations; the step loop runs on
its own thread and hands tokens to each request's queue, which the gRPC stream drains.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field

from pdserve.engine.admission import Admission, Held
from pdserve.engine.args import EngineArgs
from pdserve.engine.length_estimator import OutputLengthEstimator
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request, RequestStatus
from pdserve.sampling_params import SamplingParams
from pdserve.serving.kv_endpoint import kv_endpoint
from pdserve.serving.metrics import DecodeMetrics
from pdserve.trace import Span, now
from transfer import KV_WIRE_VERSION

FINISHED = object()  # end-of-stream marker on a request's queue


class ReservationError(RuntimeError):
    """No room for the request now (RESOURCE_EXHAUSTED at the edge)."""


@dataclass
class Reservation:
    request: Request
    deadline: float  # time.monotonic() after which the blocks go back to the pool
    reserved_at: float = field(default_factory=time.monotonic)
    cached_blocks: int = 0  # leading blocks that already hold the prompt's KV


@dataclass(frozen=True)
class Reserved:
    """What Reserve answers: the prompt's blocks, of which the first `cached_blocks` already
    hold its KV (a shared or reloaded prefix) and must not be pushed."""

    block_ids: list[int]
    cached_blocks: int = 0


@dataclass
class Stream:
    worker: str
    tokens: queue.Queue = field(default_factory=queue.Queue)
    started: float = field(default_factory=time.monotonic)
    last_token: float = field(default_factory=time.monotonic)
    # trace (wall clock): Start received, first step, pending preemption, finished spans
    received: float = field(default_factory=now)
    first_step: float | None = None
    preempted_at: float | None = None
    spans: list[Span] = field(default_factory=list)

    def stepped(self, start: float, end: float) -> None:
        if self.first_step is None:
            self.first_step = start
            self.spans.append(Span("decode.admission", self.received, start, self.worker))
        if self.preempted_at is not None:
            self.spans.append(Span("decode.preempted", self.preempted_at, start, self.worker))
            self.preempted_at = None
        self.spans.append(Span("decode.step", start, end, self.worker))

    def finished(self) -> None:
        end = now()
        if self.first_step is None:  # done at its first token: never stepped
            self.spans.append(Span("decode.admission", self.received, end, self.worker))
        else:
            self.spans.append(Span("decode.run", self.first_step, end, self.worker))


class DecodeWorker:
    def __init__(
        self,
        model: str,
        worker_id: str,
        transfer: str,
        args: EngineArgs,
        admission: str = "greedy",
        admission_margin: float = 0.05,
    ) -> None:
        # Without --prefix-offload every reserved block is fresh and the prefill worker fills
        # all of them. With it, blocks keep their prefix hashes here: a new prompt's leading
        # full blocks are shared with cached ones (device) or reloaded from the spill tiers
        # (offloaded), Reserve says how many, and the prefill worker pushes only the rest; a
        # request computed again after a preemption reloads what it had the same way.
        cache = args.prefix_offload
        self.engine = LLMEngine(model, dataclasses.replace(args, enable_prefix_caching=cache))
        self.worker_id = worker_id
        endpoint = kv_endpoint(self.engine, model, worker_id, transfer)
        self.geometry, self.layout = endpoint.geometry, endpoint.layout
        self.agent, self.region = endpoint.agent, endpoint.region
        self.metrics = DecodeMetrics()
        self.estimator = OutputLengthEstimator()
        self.admission = Admission(
            admission, self.engine.allocator, self.estimator, admission_margin
        )
        self.lock = threading.Lock()
        self.reservations: dict[str, Reservation] = {}
        self.streams: dict[str, Stream] = {}
        self.arrived: set[bytes] = set()  # push-complete notifications (request ids)
        self._in_step: set[str] = set()  # requests of the step whose model run is in flight
        self._deferred_release: set[str] = set()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        self._loop.start()

    # -- control plane ----------------------------------------------------------------------
    def reserve(
        self, request_id: str, prompt: list[int], params: SamplingParams, lease_s: float
    ) -> Reserved:
        """-> blocks for the prompt's KV. Raises ValueError (bad input) or ReservationError."""
        req = self.engine.make_request(prompt, params)
        req.request_id = request_id
        with self.lock:
            if request_id in self.reservations or request_id in self.streams:
                raise ValueError(f"request_id: {request_id!r} is already known here")
            refused = self.admission.check(prompt, params.max_tokens, self._held())
            if refused is not None:
                self.metrics.refused.inc()
                raise ReservationError(refused)
            alloc, cached = self.engine.allocator, 0
            if alloc.enable_prefix_caching:  # never the block of the last token
                req.block_ids, cached = alloc.allocate(prompt)
                cached = self.engine.prefixes.extend(prompt, req.block_ids, cached)
            else:
                req.block_ids = alloc.allocate_fresh(alloc.blocks_needed(len(prompt)))
            cached_blocks = cached // alloc.block_size
            req.metrics.cached_prompt_tokens = cached
            self.reservations[request_id] = Reservation(
                req, time.monotonic() + lease_s, cached_blocks=cached_blocks
            )
            return Reserved(list(req.block_ids), cached_blocks)

    def start(self, request_id: str, first_token: int, wait_s: float = 10.0) -> Stream:
        """The prompt's KV has been pushed: decode from `first_token` on."""
        start_wall = now()
        self._await_kv(request_id.encode(), wait_s)
        with self.lock:
            res = self.reservations.pop(request_id, None)
            if res is None:
                raise KeyError(f"no reservation for {request_id!r} (expired or released)")
            req = res.request
            req.num_computed_tokens = req.num_prompt_tokens
            req.metrics.first_token_time = time.monotonic()
            planes = self.geometry.planes_per_layer * self.engine.model_config.num_layers
            pushed = len(req.block_ids) - res.cached_blocks
            received = pushed * self.geometry.block_bytes * planes
            self.metrics.transfer_bytes.labels("received").inc(received)
            self.metrics.transfer_seconds.labels("received").observe(
                req.metrics.first_token_time - res.reserved_at
            )
            stream = Stream(self.worker_id, received=start_wall)
            self.streams[request_id] = stream
            req.append_token(first_token)
            stream.tokens.put(first_token)
            if req.status.finished:
                self._close(req)
            else:
                req.status = RequestStatus.RUNNING
                self.engine.scheduler.running.append(req)
        self._wake.set()
        return stream

    def release(self, request_id: str) -> bool:
        """Abort: the request's blocks go back to the pool whatever state it is in."""
        with self.lock:
            res = self.reservations.pop(request_id, None)
            if res is not None:
                self.engine.allocator.free(res.request.block_ids)
                return True
            if request_id in self._in_step:
                self._deferred_release.add(request_id)
                return True
            req = self.engine.scheduler.abort(request_id)
            if req is not None:
                self._close(req)
                return True
        return False

    def is_pending(self, request_id: str) -> bool:
        """Whether the request is still in the scheduler (running, waiting after a
        preemption, or parked in a spill tier): a stream that is silent for a long time while
        its request waits for room is alive, not stuck."""
        with self.lock:
            return any(r.request_id == request_id for r in self.engine.scheduler.unfinished())

    def _held(self) -> list[Held]:
        """Every request whose KV this pool holds or will hold again (lock held)."""
        held = [
            Held(r.num_tokens, r.num_output_tokens, r.params.max_tokens, tuple(r.block_ids))
            for r in self.engine.scheduler.unfinished()
        ]
        held += [
            Held(r.num_tokens, 0, r.params.max_tokens, tuple(r.block_ids))
            for r in (res.request for res in self.reservations.values())
        ]
        return held

    def stats(self) -> dict:
        """For heartbeats (the counts may be a moment stale)."""
        alloc = self.engine.allocator
        with self.lock:
            headroom = self.admission.headroom(self._held())
        return {
            "free_blocks": alloc.num_free_blocks,
            "total_blocks": alloc.num_blocks,
            "running": len(self.engine.scheduler.running),
            "headroom_blocks": headroom,
        }

    def check_integrity(self) -> None:
        with self.lock:
            owners = self.engine.scheduler.block_owners()
            for res in self.reservations.values():
                for b in res.request.block_ids:
                    owners[b] = owners.get(b, 0) + 1
            self.engine.allocator.check_integrity(owners)
            if self.engine.spiller is not None:
                self.engine.spiller.store.check_integrity()

    # -- data plane -------------------------------------------------------------------------
    def _await_kv(self, key: bytes, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            with self.lock:
                for notes in self.agent.notifications().values():
                    self.arrived.update(notes)
                if key in self.arrived:
                    self.arrived.discard(key)
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"KV of {key.decode()!r} did not arrive in {wait_s}s")
            time.sleep(0.0005)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._step():
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def _step(self) -> bool:
        """One engine step. The lock is held to schedule and to account, not while the model
        runs (the batch is plain data by then), so Reserve/Start/Release and heartbeats are
        not starved by a busy loop."""
        engine = self.engine
        with self.lock:
            self._expire_leases()
            if not engine.scheduler.has_unfinished:
                return False
            batch = engine.scheduler.schedule()
            if batch.empty:
                return False
            engine.kv_cache.copy_blocks(batch.copies)
            self._in_step = {req.request_id for req in batch.requests}
            for req in batch.preempted:
                if (stream := self.streams.get(req.request_id)) is not None:
                    stream.preempted_at = now()
        step_start = now()
        tokens, logprobs = engine.runner.execute(batch.chunks)
        step_end = now()
        with self.lock:
            for req in batch.requests:
                if (stream := self.streams.get(req.request_id)) is not None:
                    stream.stepped(step_start, step_end)
            self._account(batch, tokens, logprobs)
            self._in_step = set()
            # releases that arrived while the model ran: the step wrote into those blocks,
            # so they are freed only now (a reservation made meanwhile cannot get them)
            for request_id in self._deferred_release:
                req = engine.scheduler.abort(request_id)
                if req is not None:
                    self._close(req)
            self._deferred_release.clear()
        return True

    def _account(self, batch, tokens, logprobs) -> None:
        engine = self.engine
        finished = engine.scheduler.update(batch, tokens, logprobs)
        k, now = 0, time.monotonic()
        for req, chunk in zip(batch.requests, batch.chunks):
            if chunk.sample:
                stream = self.streams.get(req.request_id)
                if stream is not None:
                    stream.tokens.put(tokens[k])
                    self.metrics.itl.observe(now - stream.last_token)
                    stream.last_token = now
                k += 1
        for req in finished:
            self._close(req)
        alloc = engine.allocator
        self.metrics.running.set(len(engine.scheduler.running))
        self.metrics.kv_usage.set(alloc.num_used_blocks / alloc.num_blocks)
        self.metrics.account_preemption(engine.scheduler, engine.spiller)

    def _close(self, req: Request) -> None:
        if req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.estimator.observe(req.num_output_tokens)
        stream = self.streams.pop(req.request_id, None)
        if stream is not None:
            stream.finished()
            stream.tokens.put((FINISHED, req.status.value))
        if req.block_ids:  # finished at its first token: never entered the scheduler
            self.engine.allocator.free(req.block_ids)
            req.block_ids = []

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for rid in [r for r, res in self.reservations.items() if res.deadline < now]:
            self.engine.allocator.free(self.reservations.pop(rid).request.block_ids)

    def wire(self) -> dict:
        g = self.geometry
        return {
            "wire_version": KV_WIRE_VERSION,
            "layout_hash": self.layout.layout_hash(),
            "num_blocks": g.num_blocks,
            "block_bytes": g.block_bytes,
            "planes": g.planes_per_layer * self.engine.model_config.num_layers,
            "region": self.region,
        }

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._loop.join(timeout=5)
        self.agent.close()
        self.engine.close()
