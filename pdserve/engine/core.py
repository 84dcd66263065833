"""EngineCore: the one engine every role drives, through a narrow API.

    make_request(prompt, params, id)   validate (ValueError naming the field); nothing queued
    add(request)                       colocated: prefill here in chunks, then decode
    reserve(request) -> cached tokens  blocks for a prompt whose KV is computed outside the
    release(request)                   scheduler (decode's Reserve, the prefill worker's
                                       batch), and giving them back
    prefill(requests, on_layer_done)   one forward pass over reserved prompts -> first tokens
    admit_prefilled(request, token)    the prompt's KV is in its blocks: decode from here
    detach(request_id) / admit_detached  a running request leaves with its blocks (its KV
                                       migrates), or comes back when the move failed
    detach_parked / copy_parked        a parked one leaves with its KV still in the tiers
    step() -> StepOutput               = begin_step(), run(plan), end_step(plan, result)
    abort(request_id)
    stats(), held(), check_integrity()

One step reads as three lines:

    plan   = scheduler.schedule()            which tokens of which requests run (plain data)
    result = runner.execute(plan.chunks)     the model (or a cost model) computes them
    out    = scheduler.update(plan, result)  new tokens, finished requests

A role that must not hold its lock while the model runs calls the three phases itself:
`run()` touches nothing but the runner and the KV pool's bytes. An abort that arrives while
a run is in flight is applied by `end_step()` (the run still writes into those blocks), and
comes back as a finished request with reason "abort".

The core is not thread-safe: a role serialises its calls (decode: one lock; prefill: one
loop thread). `stats()` reads counters only and may be called from any thread.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from pdserve.config import ModelConfig
from pdserve.engine.batch import RunResult, ScheduledChunk
from pdserve.engine.output import EngineStats, FinishedRequest, HeldRequest, StepOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.runner import Runner
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.kv.manager import KVManager
from pdserve.outputs import RequestMetrics
from pdserve.sampling_params import SamplingParams
from pdserve.validation import Prompt, RequestValidator

_request_id = operator.attrgetter("request_id")


class EngineStalled(RuntimeError):
    """Requests wait but nothing can run: a bug, never a normal state."""


@dataclass(frozen=True)
class StepPlan:
    """A scheduled step between begin_step() and end_step()."""

    batch: ScheduledBatch
    started: float  # time.monotonic()


class EngineCore:
    def __init__(
        self,
        model_config: ModelConfig,
        scheduler: Scheduler,
        kv: KVManager,
        runner: Runner,
        validator: RequestValidator,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.model_config = model_config
        self.scheduler = scheduler
        self.kv = kv
        self.runner = runner
        self.validator = validator
        self.eos_token_ids = eos_token_ids
        self._ids = itertools.count()
        self._in_flight: StepPlan | None = None
        self._abort_after_step: set[str] = set()
        # detached requests (their KV is moving out) and whether each left parked (its KV
        # still in a tier); those aborted meanwhile end when the move does
        self._detached: dict[str, tuple[Request, bool]] = {}
        self._abort_detached: set[str] = set()

    # -- requests -------------------------------------------------------------------------
    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        field: str = "prompt",
    ) -> Request:
        """Validate everything about a request without touching engine state."""
        token_ids = self.validator.validate(prompt, params, field)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.eos_token_ids
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        n = len(token_ids)
        return Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            token_ids=token_ids,
            num_prompt_tokens=n,
            params=params,
            metrics=RequestMetrics(arrival_time=time.monotonic(), prompt_tokens=n),
            stop_ids=frozenset(stop),
            max_total_tokens=n + params.max_tokens,
            generator=generator,
        )

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def can_reserve(self, token_ids: list[int]) -> bool:
        return self.kv.can_allocate(token_ids)

    def reserve(self, request: Request, extra_tokens: int = 0) -> int:
        """Blocks for the request's prompt (and `extra_tokens` more: a migrated request's
        context grows while its KV moves), held outside the scheduler -> the leading tokens
        whose KV they already hold (shared or reloaded prefix blocks, whole blocks only;
        never the block of the prompt's last token). Raises MemoryError (nothing held
        then) when the pool cannot give the extra blocks."""
        assert not request.block_ids, f"{request.request_id} holds blocks already"
        request.block_ids, cached = self.kv.allocate_prompt(request.token_ids, request.block_hashes)
        if extra_tokens > 0:
            grown = self.kv.grow(request.block_ids, request.num_tokens, extra_tokens)
            if grown is None:
                self.kv.free(request.block_ids)
                request.block_ids = []
                raise MemoryError(f"no room for {extra_tokens} more tokens")
            self.kv.copy_blocks(list(grown))
        request.num_computed_tokens = cached
        request.committed_blocks = cached // self.kv.block_size
        request.metrics.cached_prompt_tokens = cached
        return cached

    def release(self, request: Request) -> None:
        """Give back the blocks of a request outside the scheduler (a reservation), keeping
        the hashes of every block computed by then (a later prompt may share them)."""
        if request.block_ids:
            self.kv.commit(
                request.block_ids,
                request.token_ids,
                request.num_computed_tokens,
                request.committed_blocks,
                request.block_hashes,
            )
            self.kv.free(request.block_ids)
            request.block_ids = []
            request.committed_blocks = 0

    def prefill(
        self,
        requests: list[Request],
        on_layer_done: Callable[[int], None] | None = None,
        rank_work: list | None = None,
    ) -> list[int]:
        """One forward pass over reserved prompts (after their cached tokens) -> the first
        token of each. Their KV is in their blocks afterwards; release() frees them.
        `rank_work`: under tensor parallelism, what each other rank's extension does during
        the pass (rank_results() then has their answers)."""
        chunks = []
        for req in requests:
            start = req.num_computed_tokens
            chunks.append(
                ScheduledChunk(
                    token_ids=req.token_ids[start:],
                    start=start,
                    block_ids=req.block_ids,
                    sample=True,
                    params=req.params,
                    generator=req.generator,
                )
            )
        if rank_work is None:
            result = self.runner.execute(chunks, on_layer_done=on_layer_done)
        else:
            result = self.runner.execute(chunks, on_layer_done=on_layer_done, rank_work=rank_work)
        for req in requests:
            req.num_computed_tokens = req.num_tokens
        return result.tokens

    def prefill_part(self, request: Request, tokens: int) -> int:
        """The next `tokens` of a reserved prompt computed, nothing sampled (a prompt split
        over several passes; prefill() computes the rest and samples) -> the tokens computed,
        at least one always left for prefill()."""
        start = request.num_computed_tokens
        end = min(start + tokens, request.num_tokens - 1)
        if end <= start:
            return 0
        chunk = ScheduledChunk(
            token_ids=request.token_ids[start:end],
            start=start,
            block_ids=request.block_ids,
            sample=False,
            params=request.params,
            generator=request.generator,
        )
        self.runner.execute([chunk])
        request.num_computed_tokens = end
        return end - start

    def admit_prefilled(self, request: Request, first_token: int) -> FinishedRequest | None:
        """The prompt's KV is in the request's (reserved) blocks and its first token was
        sampled elsewhere: it joins the running batch, or finishes at once (-> the output)."""
        request.num_computed_tokens = request.num_prompt_tokens
        request.metrics.first_token_time = time.monotonic()
        request.append_token(first_token)
        if request.status.finished:
            self.release(request)
            request.metrics.finished_time = time.monotonic()
            return FinishedRequest.of(request)
        self.scheduler.admit_running(request)
        return None

    def admit_reserved(self, request: Request) -> None:
        """A reserved request whose prompt no one computed (conditional disaggregation): it
        joins the running batch and its prompt is computed here, after its cached tokens, in
        the next steps' token budgets beside the decoding requests (which go first), then it
        samples its first token and decodes."""
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.monotonic()
        self.scheduler.admit_running(request)

    def abort(self, request_id: str) -> FinishedRequest | None:
        """Abort a request the scheduler holds -> its output (reason "abort"), or None when
        the core does not hold it. During a run, the abort waits for end_step()."""
        plan = self._in_flight
        if plan is not None and any(r.request_id == request_id for r in plan.batch.requests):
            self._abort_after_step.add(request_id)
            return None
        if request_id in self._detached:  # its move ends it (admit_detached)
            self._abort_detached.add(request_id)
            return None
        req = self.scheduler.abort(request_id)
        return FinishedRequest.of(req) if req is not None else None

    def kv_of(self, request_id: str) -> tuple[list[int], int, int] | None:
        """A running request's (block ids, tokens whose KV they hold, the most tokens it
        may ever have), or None when it is not running (waiting, parked, finished or
        unknown)."""
        req = self.scheduler.find(request_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            return None
        return list(req.block_ids), req.num_computed_tokens, req.max_total_tokens

    def computing_context(self, request_id: str) -> bool:
        """Whether the request is here with part of its context still to compute (a prompt
        its decode worker computes, conditional disaggregation, or one computed again after
        a preemption): its blocks do not hold its context yet, so its KV cannot move."""
        req = self.scheduler.find(request_id)
        return req is not None and req.num_computed_tokens < req.num_tokens - 1

    def hold(self, request_id: str, tokens: int | None) -> bool:
        """Let a running request's KV grow to `tokens` at most (None: no bound again): it
        waits there, not scheduled, until the bound goes (a move whose destination holds no
        more ends first) -> whether it is running here."""
        req = self.scheduler.find(request_id)
        if req is None or (tokens is not None and req.status is not RequestStatus.RUNNING):
            return False
        req.hold_at = tokens
        return True

    def detach(self, request_id: str) -> Request | None:
        """Take a running request out of the engine with its blocks, at a step boundary (its
        KV moves to another worker; handed_over() or admit_detached() ends the move) ->
        it, or None when it is not running now or is in the step under way."""
        plan = self._in_flight
        if plan is not None and any(r.request_id == request_id for r in plan.batch.requests):
            return None
        request = self.scheduler.detach(request_id)
        if request is not None:
            self._detached[request_id] = (request, False)
        return request

    def detach_parked(self, request_id: str) -> Request | None:
        """Take a parked request out of the engine, its KV left in the tiers (copy_parked()
        reads it) -> it, or None when it is not parked now."""
        request = self.scheduler.detach_parked(request_id)
        if request is not None:
            self._detached[request_id] = (request, True)
        return request

    def admit_detached(self, request: Request) -> FinishedRequest | None:
        """A detached request whose move failed runs here again (its blocks kept), or, when
        it left parked, is parked again (computed again if its KV was lost meanwhile) ->
        None; or, when it was aborted during the move, its output (reason "abort")."""
        rid = request.request_id
        _, parked = self._detached.pop(rid)
        request.hold_at = None
        if rid in self._abort_detached:
            self._abort_detached.discard(rid)
            if parked:
                self.kv.drop_parked(rid)
            self.release(request)
            request.status = RequestStatus.FINISHED_ABORTED
            request.metrics.finished_time = time.monotonic()
            return FinishedRequest.of(request)
        if parked:
            self.scheduler.readmit_parked(request)
        else:
            self.scheduler.admit_running(request)
        return None

    def parked_blocks(self, request_id: str) -> int:
        """Blocks of KV a parked (or detached parked) request keeps in the tiers."""
        return self.kv.parked_blocks(request_id)

    def copy_parked(self, request: Request, into: torch.Tensor) -> bool:
        """A detached parked request's KV into `into`, shaped like the pool with
        parked_blocks() blocks -> False when it was lost or failed its checksum."""
        return self.kv.copy_parked(request.request_id, into)

    def drop_parked(self, request: Request) -> None:
        """A detached parked request's KV is dropped from the tiers (every rank's: some
        rank's shard was lost); admitted back, it is computed again."""
        self.kv.drop_parked(request.request_id)

    def handed_over(self, request: Request) -> None:
        """A detached request's KV is at its destination: its blocks (or its parked KV)
        are given back (an abort during the move is the destination's to apply now)."""
        rid = request.request_id
        self._abort_detached.discard(rid)
        if self._detached.pop(rid)[1]:
            self.kv.drop_parked(rid)
        self.release(request)

    def is_aborting(self, request_id: str) -> bool:
        return request_id in self._abort_after_step or request_id in self._abort_detached

    # -- stepping -------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def holds_nothing(self) -> bool:
        """No request at all: none running, waiting, parked or detached (moving)."""
        return not self.scheduler.has_unfinished and not self._detached

    def preempted(self) -> int:
        """Requests waiting for room after a preemption (parked, or to be computed again)."""
        s = self.scheduler
        return len(s.parked) + sum(r.preempted_at_step is not None for r in s.waiting)

    def parked_ids(self, limit: int) -> list[str]:
        """The ids of at most `limit` parked requests, longest parked first."""
        return [r.request_id for r in itertools.islice(self.scheduler.parked, limit)]

    def preempted_waiting(self) -> bool:
        """Whether a preempted request waits for room (new ones must wait behind it)."""
        return self.scheduler.preempted_waiting()

    def rotate_by(self, rotation: Callable[[], float] | None) -> None:
        """Let parked requests take turns with running ones (Scheduler.rotation), or not."""
        self.scheduler.rotation = rotation

    def longest_preempted_wait(self) -> int:
        """Steps the longest-waiting preempted request has waited for room (0: none)."""
        return self.scheduler.longest_preempted_wait()

    @property
    def parks_victims(self) -> bool:
        """Whether a preemption parks the victim's KV in a tier (else it is recomputed)."""
        return self.scheduler.park_victims

    def tier_stats(self) -> dict[str, dict]:
        """Per spill tier, in the order parks try them: bytes, seconds, used and capacity."""
        offloaded = self.kv.offload.stats() if self.kv.offload is not None else None
        return offloaded.tiers if offloaded is not None else {}

    def holds(self, request_id: str) -> bool:
        """Whether the engine still has the request (running, waiting, parked, moving)."""
        return request_id in self._detached or self.scheduler.find(request_id) is not None

    def step(self) -> StepOutput:
        """One whole step, for a driver that owns every block of the pool (the colocated
        engine): requests waiting while nothing can run is a bug there (EngineStalled)."""
        plan = self.begin_step()
        if plan is None:
            if self.scheduler.waiting or self.scheduler.parked:
                raise EngineStalled("the scheduler made no progress with requests waiting")
            return StepOutput()
        return self.end_step(plan, self.run(plan))

    def begin_step(self) -> StepPlan | None:
        """Schedule a step (copy-on-write copies done) -> its plan, or None when nothing can
        run now (requests may still wait: for blocks a reservation holds, say)."""
        assert self._in_flight is None, "a step is in flight already"
        if not self.scheduler.has_unfinished:
            return None
        batch = self.scheduler.schedule()
        if batch.empty:
            return None
        self.kv.copy_blocks(batch.copies)
        self._in_flight = StepPlan(batch, time.monotonic())
        return self._in_flight

    def run(self, plan: StepPlan) -> RunResult:
        return self.runner.execute(plan.batch.chunks)

    def end_step(self, plan: StepPlan, result: RunResult) -> StepOutput:
        assert plan is self._in_flight, "end_step() of a plan that is not in flight"
        self._in_flight = None
        batch = plan.batch
        new, finished = self.scheduler.update(batch, result.tokens, result.logprobs)
        done = [FinishedRequest.of(r) for r in finished]
        for request_id in sorted(self._abort_after_step):
            req = self.scheduler.abort(request_id)
            if req is not None:
                done.append(FinishedRequest.of(req))
        self._abort_after_step.clear()
        return StepOutput(
            ran=tuple(map(_request_id, batch.requests)),
            tokens=tuple(new),
            finished=tuple(done),
            preempted=tuple(map(_request_id, batch.preempted)),
            parked=tuple(map(_request_id, batch.parked)),
            unparked=tuple(map(_request_id, batch.unparked)),
        )

    # -- tensor-parallel ranks ----------------------------------------------------------
    @property
    def tp_size(self) -> int:
        """Ranks the model runs on (1 without tensor parallelism)."""
        return getattr(self.runner, "tp_size", 1)

    def rank_call(self, op: str, *args) -> list:
        """Run `op` on every rank but this one (rank 0) -> their answers, rank order. The
        ops of a role's extension (`rank_call("extend", "module:Class")` installs it):
        pdserve/engine/tp_rank.py."""
        if self.tp_size == 1:
            return []
        return self.runner.group.call(op, *args)

    def rank_results(self) -> list:
        """The other ranks' answers to the last prefill() given rank_work."""
        return self.runner.collect()

    def memory(self) -> list:
        """Per rank: weight, packed-weight and KV pool bytes (pdserve/engine/memory.py)."""
        return self.runner.memory()

    def on_rank_failure(self, callback) -> None:
        """`callback(error)` once when a rank of the group dies or stops answering."""
        if self.tp_size > 1:
            self.runner.group.on_failure(callback)

    # -- views ----------------------------------------------------------------------------
    @property
    def kv_pool(self) -> torch.Tensor:
        """The pool tensor (registered with a transfer agent by the roles)."""
        return self.kv.cache.pool

    @property
    def kv_block_dim(self) -> int:
        """The pool's block dimension (pdserve/kv/kv_cache.py)."""
        return self.kv.cache.block_dim

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def token_budget(self) -> int:
        """Tokens one step (or one prefill batch) computes at most."""
        return self.scheduler.config.max_num_batched_tokens

    @property
    def free_blocks(self) -> int:
        return self.kv.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return self.kv.blocks_needed(num_tokens)

    @property
    def num_shared_blocks(self) -> int:
        """Blocks two or more requests (or reservations) hold at once."""
        return self.kv.num_shared_blocks

    def shared_blocks(self, token_ids: list[int]) -> list[int]:
        """Device blocks a new prompt would share with cached ones."""
        return self.kv.shared_blocks(token_ids)

    @property
    def max_num_seqs(self) -> int:
        """The most requests one step runs."""
        return self.scheduler.config.max_num_seqs

    def held(self) -> list[HeldRequest]:
        """Every request whose KV this pool holds or will hold again."""
        moving = (r for r, _ in self._detached.values())
        return [HeldRequest.of(r) for r in itertools.chain(self.scheduler.unfinished(), moving)]

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            parked=len(s.parked),
            preemptions=s.preemptions,
            rotations=s.rotations,
            recomputed_tokens=s.recomputed_tokens,
            pool=self.kv.stats(),
        )

    def check_integrity(self, reserved: Iterable[Request] = ()) -> None:
        """Every block is owned by exactly the requests holding it (the scheduler's and the
        given reservations), and the parked KV is exactly that of the parked requests."""
        owners = self.scheduler.block_owners()
        for req in itertools.chain(reserved, (r for r, _ in self._detached.values())):
            for b in req.block_ids:
                owners[b] = owners.get(b, 0) + 1
        parked = {r.request_id for r in self.scheduler.parked}
        parked |= {rid for rid, (_, was_parked) in self._detached.items() if was_parked}
        self.kv.check_integrity(owners, parked)
        for req in self.scheduler.running:
            assert req.status is RequestStatus.RUNNING, f"{req.request_id} runs as {req.status}"

    def close(self) -> None:
        """Release the spill tiers (the disk tier's directory goes with them) and whatever
        the runner started (a tensor-parallel group's other ranks)."""
        self.kv.close()
        self.runner.close()
