"""Admission policies: may a new request's KV join this decode worker's pool now?

`greedy` (the baseline, as vLLM v1 and SGLang do): admit while the prompt's blocks are free
now. `kv-aware`: admit only while the projected demand fits,

    sum over held requests of blocks(len_r + E_rem(g_r, M_r))
      + blocks(prompt + E_rem(0, M_new))  <=  (1 - margin) * pool blocks

and the prompt's blocks are free now; held requests are the running, reserved and parked
(spilled) ones, len_r the tokens whose KV they hold or will hold, g_r their generated tokens
and M_r their max_tokens; E_rem is the online estimate of decode/length_estimator.py.
A block several requests share (a cached prefix, with prefix caching on) counts once: each
request's term leaves out the blocks already counted for an earlier one, and the new
request's leaves out the held blocks its prompt would share.
A request refused here waits (its TTFT grows) instead of being preempted later.

Both policies answer in one unit, blocks of headroom: `headroom(held)` is what a new
request could still count on (what the router routes on) and `cost(prompt, max_tokens)` is
how much of it one admitted request takes (what the router subtracts until the next
heartbeat).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from decode.length_estimator import OutputLengthEstimator
from pdserve.engine.output import HeldRequest
from pdserve.registry import Registry


class PoolView(Protocol):
    """What admission reads of the engine core's pool (EngineCore provides it)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...

    def blocks_needed(self, num_tokens: int) -> int: ...

    def can_reserve(self, token_ids: list[int]) -> bool: ...

    def shared_blocks(self, token_ids: list[int]) -> list[int]: ...


class GreedyAdmission:
    """Admit whenever the prompt's blocks are free now."""

    def __init__(self, pool: PoolView, estimator: OutputLengthEstimator, margin: float) -> None:
        self.pool = pool

    def headroom(self, held: Sequence[HeldRequest]) -> int:
        return self.pool.free_blocks

    def cost(self, prompt: list[int], max_tokens: int) -> int:
        return self.pool.blocks_needed(len(prompt)) - len(self.pool.shared_blocks(prompt))

    def check(self, prompt: list[int], max_tokens: int, held: Sequence[HeldRequest]) -> str | None:
        """None when the request may be admitted, else why not."""
        pool = self.pool
        if not pool.can_reserve(prompt):
            return f"{pool.blocks_needed(len(prompt))} KV blocks needed, {pool.free_blocks} free"
        return None


class KVAwareAdmission(GreedyAdmission):
    """Admit while every held request's expected growth still fits."""

    def __init__(self, pool: PoolView, estimator: OutputLengthEstimator, margin: float) -> None:
        super().__init__(pool, estimator, margin)
        self.estimator = estimator
        self.margin = margin

    @property
    def budget(self) -> int:
        return int((1 - self.margin) * self.pool.num_blocks)

    def projected_blocks(self, held: Sequence[HeldRequest]) -> int:
        seen: set[int] = set()
        total = 0
        for h in held:
            remaining = round(self.estimator.remaining(h.generated, h.max_tokens))
            total += self.pool.blocks_needed(h.tokens + remaining) - len(
                seen.intersection(h.block_ids)
            )
            seen.update(h.block_ids)
        return total

    def headroom(self, held: Sequence[HeldRequest]) -> int:
        return self.budget - self.projected_blocks(held)

    def _new(self, prompt: list[int], max_tokens: int) -> HeldRequest:
        return HeldRequest("", len(prompt), 0, max_tokens, tuple(self.pool.shared_blocks(prompt)))

    def cost(self, prompt: list[int], max_tokens: int) -> int:
        new = self._new(prompt, max_tokens)
        return self.projected_blocks([new]) - len(new.block_ids)

    def check(self, prompt: list[int], max_tokens: int, held: Sequence[HeldRequest]) -> str | None:
        refused = super().check(prompt, max_tokens, held)
        if refused is not None:
            return refused
        demand = self.projected_blocks([*held, self._new(prompt, max_tokens)])
        if demand > self.budget:
            return f"projected KV demand {demand} blocks exceeds {self.budget} (kv-aware admission)"
        return None


ADMISSION: Registry[type[GreedyAdmission]] = Registry(
    "admission", {"greedy": GreedyAdmission, "kv-aware": KVAwareAdmission}
)
