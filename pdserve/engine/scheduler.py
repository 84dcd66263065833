"""Continuous batching with chunked prefill under a token budget.

Each step: every running request gets its next tokens (one for decoding requests, the rest of
its prompt up to the budget for prefilling ones), in admission order; then waiting requests
are admitted while the budget, `max_num_seqs` and free KV blocks allow. A running request that
cannot get a block preempts the most recently admitted one (the victim: it has made the least
progress since admission, and LIFO keeps the oldest requests moving).

What happens to the victim's KV is the preemption policy (`SchedulerConfig.preemption`):
`recompute` drops it and the request waits to be computed again (from its prefix-cache hits
where they survive, on the device or offloaded to the tiers: pdserve/kv/prefix_offload.py);
`swap`/`tiered` hand its blocks to the spiller (host, then CXL, then disk), free them, and
park the request in `swapped`; parked requests come back, their KV reloaded into fresh
blocks, before any new request is admitted. A spill no tier can take, or
a reload that fails (lost, checksum), falls back to recompute.

The runner gets plain data (`ScheduledChunk`), never the scheduler's own objects.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from pdserve.config import SchedulerConfig
from pdserve.engine.request import Request, RequestStatus
from pdserve.kv import BlockAllocator
from pdserve.sampling_params import SamplingParams


@dataclass
class ScheduledChunk:
    token_ids: list[int]  # the tokens to compute this step
    start: int  # position of token_ids[0] (= tokens already in the cache)
    block_ids: list[int]  # the request's block table
    sample: bool  # the chunk ends the known tokens: sample the next one
    params: SamplingParams
    generator: torch.Generator | None


@dataclass
class ScheduledBatch:
    requests: list[Request]  # parallel to chunks
    chunks: list[ScheduledChunk]
    copies: list[tuple[int, int]]  # copy-on-write block copies to do before running
    preempted: list[Request]

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, allocator: BlockAllocator, spiller=None, prefixes=None
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # preempted, KV parked in a spill tier
        # pdserve.kv.spill.KVSpiller (or anything with spill/reload/discard)
        self.spiller = spiller if config.preemption != "recompute" else None
        # pdserve.kv.prefix_offload.PrefixOffload: reloads offloaded prefix blocks on admission
        self.prefixes = prefixes
        self.preemptions = 0
        self.recomputed_tokens = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def unfinished(self):
        """Every request not finished: running, waiting (new or to recompute), parked."""
        yield from self.running
        yield from self.waiting
        yield from self.swapped

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch([], [], [], [])
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self._make_room(req, n, batch):
                batch.copies += self.allocator.append_slots(
                    req.block_ids, req.num_computed_tokens, n
                )
                self._add_chunk(batch, req, n)
                budget -= n
                idx += 1
            else:
                break  # req itself was preempted; everything after it is gone too
        budget = self._swap_in(batch, budget)
        while self.waiting and budget > 0 and not batch.preempted and not self.swapped:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            if not self.allocator.can_allocate(req.token_ids):
                break
            self.waiting.popleft()
            req.block_ids, cached = self.allocator.allocate(req.token_ids)
            if self.prefixes is not None:
                cached = self.prefixes.extend(req.token_ids, req.block_ids, cached)
            req.num_computed_tokens = cached
            if req.dropped_tokens:  # computed before a preemption dropped them
                redo = max(0, req.dropped_tokens - cached)
                req.metrics.recomputed_tokens += redo
                self.recomputed_tokens += redo
                req.dropped_tokens = 0
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
                req.metrics.cached_prompt_tokens = cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            n = min(req.num_tokens - cached, budget)
            self._add_chunk(batch, req, n)
            budget -= n
        return batch

    def _make_room(self, req: Request, n: int, batch: ScheduledBatch) -> bool:
        """Preempt from the tail until `req` can grow by n tokens; False if req was the victim."""
        while not self.allocator.can_append(req.block_ids, req.num_computed_tokens, n):
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _swap_in(self, batch: ScheduledBatch, budget: int) -> int:
        """Bring parked requests back, oldest first, while their KV and next token fit."""
        while self.swapped and budget > 0 and not batch.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.swapped[0]
            if self.allocator.blocks_needed(req.num_tokens) > self.allocator.num_free_blocks:
                break
            self.swapped.popleft()
            blocks = self.allocator.allocate_fresh(
                self.allocator.blocks_needed(req.num_computed_tokens)
            )
            if not self.spiller.reload(req.request_id, blocks):
                self.allocator.free(blocks)
                self._drop_kv(req)
                self.waiting.appendleft(req)
                continue
            req.block_ids = blocks
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            batch.copies += self.allocator.append_slots(req.block_ids, req.num_computed_tokens, n)
            self._add_chunk(batch, req, n)
            budget -= n
        return budget

    def _preempt(self, req: Request) -> None:
        req.metrics.preemptions += 1
        self.preemptions += 1
        req.status = RequestStatus.WAITING
        computed = req.num_computed_tokens
        if self.spiller is not None and computed > 0:
            held = req.block_ids[: self.allocator.blocks_needed(computed)]
            if self.spiller.spill(req.request_id, held) is not None:
                self.allocator.free(req.block_ids)
                req.block_ids = []
                req.metrics.spills += 1
                self.swapped.append(req)
                return
        self.allocator.free(req.block_ids)
        req.block_ids = []
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
        batch.requests.append(req)
        batch.chunks.append(
            ScheduledChunk(
                token_ids=req.token_ids[start : start + n],
                start=start,
                block_ids=req.block_ids,
                sample=start + n == req.num_tokens,
                params=req.params,
                generator=req.generator,
            )
        )

    def update(
        self, batch: ScheduledBatch, sampled: list[int], logprobs: list[dict[int, float]] | None
    ) -> list[Request]:
        """Account a finished step: computed tokens, new tokens, finished requests."""
        finished, k, now = [], 0, time.monotonic()
        for req, chunk in zip(batch.requests, batch.chunks):
            req.num_computed_tokens += len(chunk.token_ids)
            self.allocator.commit(req.block_ids, req.token_ids, req.num_computed_tokens)
            if not chunk.sample:
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if logprobs is not None:
                req.logprobs.append(logprobs[k])
            req.append_token(sampled[k])
            k += 1
            if req.status.finished:
                self._finish(req, now)
                finished.append(req)
        return finished

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting, self.swapped):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    if queue is self.swapped:
                        self.spiller.discard(request_id)
                    req.status = RequestStatus.FINISHED_ABORTED
                    self._release(req, time.monotonic())
                    return req
        return None

    def _finish(self, req: Request, now: float) -> None:
        self.running.remove(req)
        self._release(req, now)

    def _release(self, req: Request, now: float) -> None:
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []
        req.metrics.finished_time = now

    def block_owners(self) -> dict[int, int]:
        """block -> number of running requests holding it (for check_integrity)."""
        owners: dict[int, int] = {}
        for req in self.running:
            for b in req.block_ids:
                owners[b] = owners.get(b, 0) + 1
        return owners
