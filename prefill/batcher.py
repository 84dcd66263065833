"""Prompts in arrival order, cut into batches under a token budget (a batch holds at most
the budget's tokens, or one prompt alone; the prompt that would cross it opens the next).

A prompt whose blocks were not free when its batch ran is carried: it goes first in the
next batch (every batch frees its blocks once its push is done, so it fits then). `close()`
ends the stream of batches after the jobs already queued.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from pdserve.engine.core import EngineCore
from pdserve.engine.request import Request
from pdserve.serving.destination import Destination
from pdserve.trace import now


@dataclass
class PrefillJob:
    request: Request
    dest: Destination
    done: Future = field(default_factory=Future)  # -> PrefillResult
    # time.monotonic(): the caller's deadline, by which every WRITE posted for it is complete
    # or given up, and the last moment a WRITE may be posted (earlier: room for it to land)
    deadline: float = float("inf")
    post_by: float = float("inf")
    enqueued: float = field(default_factory=time.monotonic)
    enqueued_wall: float = field(default_factory=now)
    # whether its caller went away (a cancelled call): dropped if it has not started
    gone: Callable[[], bool] = lambda: False

    @property
    def tokens(self) -> int:
        return self.request.num_tokens


class Batcher:
    def __init__(self, budget_tokens: int) -> None:
        self.budget = budget_tokens
        self._jobs: queue.Queue[PrefillJob | None] = queue.Queue()
        self._carried: deque[PrefillJob] = deque()

    def put(self, job: PrefillJob) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)

    def carry(self, job: PrefillJob) -> None:
        """`job` goes in the next batch, before every later arrival carried too."""
        i = len(self._carried)
        while i and self._carried[i - 1].enqueued > job.enqueued:
            i -= 1
        self._carried.insert(i, job)

    def next_batch(self) -> list[PrefillJob] | None:
        """Blocks until there is a job -> carried jobs first, then queued ones, in order,
        as many as the token budget holds (at least one job: a prompt longer than the budget
        goes alone); None once closed."""
        first = self._carried.popleft() if self._carried else self._jobs.get()
        if first is None:
            return None
        batch, tokens = [first], first.tokens
        while self._carried and tokens + self._carried[0].tokens <= self.budget:
            batch.append(self._carried.popleft())
            tokens += batch[-1].tokens
        while tokens < self.budget and not self._carried:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._jobs.put(None)  # closed: the next call answers None
                break
            if tokens + job.tokens > self.budget:
                self.carry(job)  # it opens the next batch
                break
            batch.append(job)
            tokens += job.tokens
        return batch


def reserve_batch(core: EngineCore, batch: list[PrefillJob], batcher: Batcher) -> list[PrefillJob]:
    """Blocks for every job of the batch that fits now (prefix-cache hits, device or
    offloaded, are not computed again) -> those jobs; the others are carried to the next
    batch. A prompt admitted at submit fits the empty pool, and every batch frees its blocks,
    so a carried prompt fits once the jobs ahead of it are done."""
    runnable = []
    for job in batch:
        if not core.can_reserve(job.request.token_ids):
            assert runnable, "a lone prompt must fit the empty pool"
            batcher.carry(job)
            continue
        core.reserve(job.request)
        runnable.append(job)
    return runnable
