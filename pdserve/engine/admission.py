"""Admission policies: may a new request's KV join this worker's pool now?

`greedy` (the baseline, as vLLM v1 and SGLang do): admit while the prompt's blocks are free
now. `kv-aware`: admit only while the projected demand fits,

    sum over held requests of blocks(len_r + E_rem(g_r, M_r))
      + blocks(prompt + E_rem(0, M_new))  <=  (1 - margin) * pool blocks

and the prompt's blocks are free now; held requests are the running, reserved and parked
(spilled) ones, len_r the tokens whose KV they hold or will hold, g_r their generated tokens
and M_r their max_tokens; E_rem is the online estimate of pdserve/engine/length_estimator.py.
A block several requests share (a cached prefix, with prefix caching on) counts once: each
request's term leaves out the blocks already counted for an earlier one, and the new
request's leaves out the held blocks its prompt would share.
A request refused here waits (its TTFT grows) instead of being preempted later.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.length_estimator import OutputLengthEstimator
from pdserve.kv import BlockAllocator

POLICIES = ("greedy", "kv-aware")


@dataclass(frozen=True)
class Held:
    tokens: int  # tokens whose KV the request holds (or will, once its prompt arrives)
    generated: int
    max_tokens: int
    block_ids: tuple[int, ...] = ()  # the blocks it holds now (shared ones count once)


class Admission:
    def __init__(
        self,
        policy: str,
        allocator: BlockAllocator,
        estimator: OutputLengthEstimator,
        margin: float = 0.05,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"admission: {policy!r}; choose one of {', '.join(POLICIES)}")
        if not 0 <= margin < 1:
            raise ValueError(f"admission margin: must be in [0, 1), got {margin}")
        self.policy, self.allocator, self.estimator, self.margin = (
            policy,
            allocator,
            estimator,
            margin,
        )

    def projected_blocks(self, held: list[Held]) -> int:
        alloc, seen, total = self.allocator, set(), 0
        for h in held:
            need = alloc.blocks_needed(
                h.tokens + round(self.estimator.remaining(h.generated, h.max_tokens))
            )
            total += need - len(seen.intersection(h.block_ids))
            seen.update(h.block_ids)
        return total

    def headroom(self, held: list[Held]) -> int:
        """Blocks a new request could still count on: free blocks now (greedy), or the budget
        minus the projected demand of everything held (kv-aware). What the router routes on."""
        if self.policy == "greedy":
            return self.allocator.num_free_blocks
        budget = int((1 - self.margin) * self.allocator.num_blocks)
        return budget - self.projected_blocks(held)

    def check(self, prompt: list[int], max_tokens: int, held: list[Held]) -> str | None:
        """None when the request may be admitted, else why not."""
        alloc = self.allocator
        if not alloc.can_allocate(prompt):
            return (
                f"{alloc.blocks_needed(len(prompt))} KV blocks needed, {alloc.num_free_blocks} free"
            )
        if self.policy == "greedy":
            return None
        new = Held(len(prompt), 0, max_tokens, tuple(alloc.match_prefix(prompt)))
        demand = self.projected_blocks([*held, new])
        budget = int((1 - self.margin) * alloc.num_blocks)
        if demand > budget:
            return f"projected KV demand {demand} blocks exceeds {budget} (kv-aware admission)"
        return None
