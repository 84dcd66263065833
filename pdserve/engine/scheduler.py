"""Continuous batching with chunked prefill under a token budget.

Each step: every running request gets its next tokens (one for decoding requests, the rest of
its prompt up to the budget for prefilling ones), in the running list's order (admission
order, except that a decoding request joins ahead of the requests still computing their
context: Scheduler._join); then parked requests come back; then waiting requests are
admitted while the budget, `max_num_seqs` and free KV blocks allow. A running request that
cannot get a block preempts the one at the list's end: the most recently admitted, or a
request still computing its context that a later decoder went ahead of (the victim: it has
made the least progress, and LIFO keeps the oldest requests moving; a context half computed
costs less to lose than a pushed one).

With a rotation installed (`rotation`, by the cost-aware admission policy), a step first
gives the most slowed-down parked request a turn (`_rotate`), and a decoding request back
from a stall joins the front of the batch instead of its end: the last to be a victim again.

What happens to the victim's KV is the preemption policy (`SchedulerConfig.preemption`):
`recompute` drops it and the request waits to be computed again (from its prefix-cache hits
where they survive, on the device or offloaded to the tiers); `swap`/`tiered` park its
blocks in the tiers (host, then CXL, then disk), free them, and keep the request in
`parked`; parked requests come back, their KV unpacked into fresh blocks, before any new
request is admitted. A park no tier can take, or an unpark that fails (lost, checksum),
falls back to recompute.

The scheduler keeps books only: blocks through the KVManager, bytes never. The runner gets
plain data (`ScheduledChunk`), never the scheduler's own objects.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.output import NewToken
from pdserve.engine.request import Request, RequestStatus
from pdserve.kv.manager import KVManager

# builds a NamedTuple from a tuple without its Python-level __new__: the scheduler makes one
# ScheduledChunk and one NewToken per request per step
_tuple_of = tuple.__new__


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)  # parallel to chunks
    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before running
    preempted: list[Request] = field(default_factory=list)  # every victim of this step
    parked: list[Request] = field(default_factory=list)  # victims whose KV went to a tier
    unparked: list[Request] = field(default_factory=list)  # parked requests brought back

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: deque[Request] = deque()  # preempted, KV in a spill tier
        self.park_victims = config.preemption != "recompute" and kv.can_park
        self.preemptions = 0
        self.recomputed_tokens = 0
        self.steps = 0  # schedule() calls: the clock preemption stalls are counted on
        # rotation (_rotate): the steps a running request runs, per block it holds, before a
        # parked one may take its turn (at least one step); None: no rotation, each parked
        # request waits for room and the victim is the most recently admitted (vLLM's way).
        # The cost-aware admission policy installs it (pdserve/engine/admission.py).
        self.rotation: Callable[[], float] | None = None
        self.rotations = 0
        self._turn_backoff = 1  # steps between tries while no turn can be made
        self._next_turn_try = 0

    # -- requests -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """A new request: its prompt is computed here, in chunks, before it decodes."""
        self.waiting.append(request)

    def admit_running(self, request: Request) -> None:
        """A request whose computed tokens' KV is already in its blocks joins the batch."""
        assert request.block_ids, "a running request holds its blocks"
        request.status = RequestStatus.RUNNING
        request.running_since = self.steps
        if request.preempted_at_step is None:
            self._join(request)
            return
        request.stalled_steps += self.steps - request.preempted_at_step
        request.preempted_at_step = None
        # back from a stall with only its next token to compute: the last to be a victim
        # again. One still to prefill (recomputed, or parked mid-prompt) keeps to the end:
        # at the front it would take the step's token budget before the decoding requests.
        if self.rotation is not None and request.num_tokens - request.num_computed_tokens <= 1:
            self.running.insert(0, request)
        else:
            self._join(request)

    def _join(self, request: Request) -> None:
        """Into the running list: at its end, or, for a request with only its next token to
        compute, ahead of the first one still computing its context (a prompt its decode
        worker computes, or a context computed again). The running list spends each step's
        token budget in order: a long context ahead of it would take the whole budget and
        leave it, and every decoder after it, out of the step."""
        running = self.running
        at = len(running)
        if request.num_tokens - request.num_computed_tokens <= 1:
            # they collect at the end (decoders join ahead of them, and none turns back into
            # one still computing): the scan stops at the first decoder from the end
            while at and running[at - 1].num_tokens - running[at - 1].num_computed_tokens > 1:
                at -= 1
        running.insert(at, request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def unfinished(self) -> Iterator[Request]:
        """Every request not finished: running, waiting (new or to recompute), parked."""
        yield from self.running
        yield from self.waiting
        yield from self.parked

    def find(self, request_id: str) -> Request | None:
        return next((r for r in self.unfinished() if r.request_id == request_id), None)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        self.steps += 1
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch()
        # the hot loop, one pass per request (the simulator runs it millions of times, so
        # its lookups are bound once). A preemption pops victims off the list's tail, which
        # ends the iteration before them.
        if self.rotation is not None:
            if self.parked:
                self._rotate(batch)
            elif self._next_turn_try:  # nothing parked: the next stall starts afresh
                self._turn_backoff, self._next_turn_try = 1, 0
        grow, add = self.kv.grow, self._add_chunk
        for req in self.running:
            if budget <= 0:
                break
            start = req.num_computed_tokens
            n = len(req.token_ids) - start
            if n > budget:
                n = budget
            if req.hold_at is not None:  # being moved: it waits at the destination's size
                n = min(n, req.hold_at - start)
                if n <= 0:
                    continue
            copies = grow(req.block_ids, start, n)
            if copies is None:
                copies = self._make_room(req, n, batch)
                if copies is None:
                    break  # req itself was preempted; everything after it is gone too
            if copies:
                batch.copies += copies
            add(batch, req, n)
            budget -= n
        budget = self._unpark(batch, budget)
        while self.waiting and budget > 0 and not batch.preempted and not self.parked:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            if not self.kv.can_allocate(req.token_ids, req.block_hashes):
                break
            self.waiting.popleft()
            req.block_ids, cached = self.kv.allocate_prompt(req.token_ids, req.block_hashes)
            req.num_computed_tokens = cached
            req.committed_blocks = cached // self.kv.block_size
            if req.dropped_tokens:  # computed before a preemption dropped them
                redo = max(0, req.dropped_tokens - cached)
                req.metrics.recomputed_tokens += redo
                self.recomputed_tokens += redo
                req.dropped_tokens = 0
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
                req.metrics.cached_prompt_tokens = cached
            self.admit_running(req)
            n = min(req.num_tokens - cached, budget)
            self._add_chunk(batch, req, n)
            budget -= n
        return batch

    def preempted_waiting(self) -> bool:
        """Whether a preempted request (parked, or to be computed again) waits for room."""
        return bool(self.parked) or any(r.preempted_at_step is not None for r in self.waiting)

    def longest_preempted_wait(self) -> int:
        """Steps the longest-waiting preempted request (parked or to be computed again) has
        waited for room; 0 when none waits."""
        since = [r.preempted_at_step for r in self.parked]
        since += [r.preempted_at_step for r in self.waiting if r.preempted_at_step is not None]
        return self.steps - min(since) if since else 0

    ROTATE_RATIO = 2.0  # a parked request takes a turn at this many times a runner's slowdown

    def slowdown(self, req: Request) -> float:
        """Steps per generated token it has lived, its stalls counted: 1 for a request that
        never waited, growing by 1/tokens for each step it waits now (its TPOT against an
        unstalled one's, in steps)."""
        stalled = req.stalled_steps
        if req.preempted_at_step is not None:
            stalled += self.steps - req.preempted_at_step
        return 1.0 + stalled / max(1, req.num_output_tokens)

    def _rotate(self, batch: ScheduledBatch) -> None:
        """Give the most slowed-down parked request p (one that has generated a token: its
        TPOT is what slowdown measures) a turn when its slowdown is more than ROTATE_RATIO
        times some runners': when p fits now, it goes to the front of the parked line (so
        _unpark brings it back first); else runners under slowdown(p) / ROTATE_RATIO are
        parked, least slowed first, each having run its rotation steps since it came in,
        when their blocks (and seats, under max_num_seqs) make room for p and for the
        others' growth this step, and the tiers can take them all; p comes back at once.
        While no turn can be made, tries come at doubling intervals (up to 16 steps)."""
        if self.steps < self._next_turn_try:
            return
        slowdown = self.slowdown
        p = max((r for r in self.parked if r.num_output_tokens), key=slowdown, default=None)
        if p is None:
            return
        limit = slowdown(p) / self.ROTATE_RATIO
        if limit <= 1.0:
            return  # nobody runs below slowdown 1: not owed a turn yet
        need = self.kv.blocks_needed(p.num_tokens)
        free = self.kv.num_free_blocks
        seats = len(self.running) + 1 - self.config.max_num_seqs  # runners to leave for one
        if need <= free and seats <= 0:
            if self.parked[0] is not p:
                self.parked.remove(p)
                self.parked.appendleft(p)
            return
        now, per_block = self.steps, self.rotation()
        heap = [
            (s, i, r)
            for i, r in enumerate(self.running)
            if (s := slowdown(r)) < limit
            and r.num_output_tokens
            and r.hold_at is None
            and now - r.running_since >= max(1, math.ceil(per_block * len(r.block_ids)))
        ]
        heapq.heapify(heap)
        growth = sum(map(self._growth, self.running))
        victims: list[Request] = []
        while heap and (free < need + growth or len(victims) < seats):
            r = heapq.heappop(heap)[2]
            victims.append(r)
            free += self.kv.exclusive_blocks(r.block_ids)
            growth -= self._growth(r)
        blocks = [self.kv.blocks_needed(v.num_computed_tokens) for v in victims]
        if free < need + growth or len(victims) < seats or not self.kv.tiers_take(blocks):
            # no turn now (and none bought with a recompute: the tiers must take them all)
            self._next_turn_try = self.steps + self._turn_backoff
            self._turn_backoff = min(16, 2 * self._turn_backoff)
            return
        self._turn_backoff = 1
        gone = set(map(id, victims))
        self.running = [r for r in self.running if id(r) not in gone]
        for v in victims:
            self._preempt(v, batch)
        self.parked.remove(p)
        if self._bring_back(p, batch):
            self.rotations += 1

    def _growth(self, req: Request) -> int:
        """Blocks a running request needs this step to grow (decoding: its next token)."""
        short = self.kv.blocks_needed(req.num_tokens) - len(req.block_ids)
        return short if short > 0 else 0

    def _make_room(self, req: Request, n: int, batch: ScheduledBatch) -> tuple | None:
        """Preempt from the tail until `req` can grow by n tokens -> its copy-on-write
        pairs, or None if req itself was the victim."""
        while (copies := self.kv.grow(req.block_ids, req.num_computed_tokens, n)) is None:
            victim = self.running.pop()
            self._preempt(victim, batch)
            if victim is req:
                return None
        return copies

    def _unpark(self, batch: ScheduledBatch, budget: int) -> int:
        """Bring parked requests back, oldest first, while their KV and next token fit."""
        while self.parked and budget > 0 and not batch.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.parked[0]
            if self.kv.blocks_needed(req.num_tokens) > self.kv.num_free_blocks:
                break
            self.parked.popleft()
            if not self._bring_back(req, batch):
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            copies = self.kv.grow(req.block_ids, req.num_computed_tokens, n)
            assert copies is not None, "a parked request comes back only when its blocks fit"
            batch.copies += copies
            self._add_chunk(batch, req, n)
            budget -= n
        return budget

    def _bring_back(self, req: Request, batch: ScheduledBatch) -> bool:
        """A request taken out of `parked` -> whether it runs again, its KV unpacked into
        fresh blocks; else (lost, corrupt) it waits to be computed again."""
        blocks = self.kv.allocate_fresh(self.kv.blocks_needed(req.num_computed_tokens))
        if not self.kv.unpark(req.request_id, blocks):
            self.kv.free(blocks)
            self._drop_kv(req)
            self.waiting.appendleft(req)
            return False
        req.block_ids = blocks
        req.committed_blocks = 0  # fresh blocks: registered again as they are committed
        self.admit_running(req)
        batch.unparked.append(req)
        return True

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        req.metrics.preemptions += 1
        self.preemptions += 1
        req.preempted_at_step = self.steps
        batch.preempted.append(req)
        req.status = RequestStatus.WAITING
        computed = req.num_computed_tokens
        held = req.block_ids[: self.kv.blocks_needed(computed)]
        parked = self.park_victims and computed > 0 and self.kv.park(req.request_id, held)
        self.kv.free(req.block_ids)
        req.block_ids = []
        req.committed_blocks = 0
        if parked:
            req.metrics.spills += 1
            batch.parked.append(req)
            self.parked.append(req)
        else:
            self._drop_kv(req)
            self.waiting.appendleft(req)

    def _drop_kv(self, req: Request) -> None:
        """The request's KV is gone: what it had computed will be computed again when it is
        admitted, less what the prefix cache (device or offloaded) still holds then."""
        req.dropped_tokens = max(req.dropped_tokens, req.num_computed_tokens)
        req.num_computed_tokens = 0

    @staticmethod
    def _add_chunk(batch: ScheduledBatch, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        tokens = req.token_ids
        batch.requests.append(req)
        batch.chunks.append(
            _tuple_of(
                ScheduledChunk,
                (
                    tokens[start : start + n],  # token_ids
                    start,
                    req.block_ids,
                    start + n == len(tokens),  # sample
                    req.params,
                    req.generator,
                ),
            )
        )

    def update(
        self, batch: ScheduledBatch, sampled: list[int], logprobs: list[dict[int, float]] | None
    ) -> tuple[list[NewToken], list[Request]]:
        """Account a finished step -> (the new token of every request that sampled, the
        requests that finished)."""
        new, finished, k, now = [], [], 0, time.monotonic()
        bs, commit = self.kv.block_size, self.kv.commit
        for req, chunk in zip(batch.requests, batch.chunks):  # the hot loop
            computed = req.num_computed_tokens = req.num_computed_tokens + len(chunk.token_ids)
            if computed // bs > req.committed_blocks:  # a block filled up
                req.committed_blocks = commit(
                    req.block_ids, req.token_ids, computed, req.committed_blocks, req.block_hashes
                )
            if not chunk.sample:
                continue
            metrics = req.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if logprobs is not None:
                req.logprobs.append(logprobs[k])
            token = sampled[k]
            new.append(_tuple_of(NewToken, (req.request_id, token)))
            k += 1
            if req.append_token(token):
                self._release(req, now)
                finished.append(req)
        if finished:  # out of the batch in one pass (remove() per request is quadratic)
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
        return new, finished

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting, self.parked):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    if queue is self.parked:
                        self.kv.drop_parked(request_id)
                    req.status = RequestStatus.FINISHED_ABORTED
                    self._release(req, time.monotonic())
                    return req
        return None

    def detach(self, request_id: str) -> Request | None:
        """Take a running request out of the batch with its blocks (its KV moves to another
        worker: the caller frees them) -> it, or None when it is not running now."""
        for req in self.running:
            if req.request_id == request_id:
                self.running.remove(req)
                return req
        return None

    def detach_parked(self, request_id: str) -> Request | None:
        """Take a parked request out of the queue, its KV left in the tiers (it moves to
        another worker from there) -> it, or None when it is not parked now."""
        for req in self.parked:
            if req.request_id == request_id:
                self.parked.remove(req)
                return req
        return None

    def readmit_parked(self, req: Request) -> None:
        """A request taken out by detach_parked() comes back first in line: parked while its
        KV is, else (lost or corrupt on the way) to be computed again."""
        if self.kv.is_parked(req.request_id):
            self.parked.appendleft(req)
        else:
            self._drop_kv(req)
            self.waiting.appendleft(req)

    def _release(self, req: Request, now: float) -> None:
        if req.block_ids:
            self.kv.free(req.block_ids)
            req.block_ids = []
        req.metrics.finished_time = now

    def block_owners(self) -> dict[int, int]:
        """block -> number of running requests holding it (for check_integrity)."""
        owners: dict[int, int] = {}
        for req in self.running:
            for b in req.block_ids:
                owners[b] = owners.get(b, 0) + 1
        return owners
