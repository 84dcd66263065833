"""What the engine core hands back: plain data, copied out of its own objects.

StepOutput       one step: every new token, every request that finished (or was aborted
                 during the step), and what the step did to the others (preempted,
                 parked in a tier, brought back)
EngineStats      counters and pool state, for metrics and `LLM.stats()`
HeldRequest      a request whose KV the pool holds or will hold again (admission's input)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from pdserve.engine.request import Request
from pdserve.outputs import RequestMetrics

if TYPE_CHECKING:
    from pdserve.kv.manager import PoolStats


class NewToken(NamedTuple):  # one per request per step: a tuple is the cheapest to make
    request_id: str
    token: int


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prior_output_tokens: int = 0  # generated before this engine held it (Request's)

    @property
    def output_length(self) -> int:
        """Its whole output: what it generated here and before (a migration's)."""
        return self.prior_output_tokens + len(self.output_token_ids)

    @property
    def completed(self) -> bool:
        """Finished by a stop token or its length limit (not aborted)."""
        return self.finish_reason != "abort"

    @staticmethod
    def of(req: Request) -> FinishedRequest:
        return FinishedRequest(
            request_id=req.request_id,
            finish_reason=req.status.value,
            prompt_token_ids=req.token_ids[: req.num_prompt_tokens],
            output_token_ids=list(req.output_token_ids),
            metrics=req.metrics,
            logprobs=list(req.logprobs),
            prior_output_tokens=req.prior_output_tokens,
        )


@dataclass(frozen=True)
class StepOutput:
    ran: tuple[str, ...] = ()  # requests that computed tokens this step
    tokens: tuple[NewToken, ...] = ()  # in batch order
    finished: tuple[FinishedRequest, ...] = ()
    preempted: tuple[str, ...] = ()  # every request preempted this step
    parked: tuple[str, ...] = ()  # the preempted ones whose KV went to a tier
    unparked: tuple[str, ...] = ()  # parked requests brought back, their KV reloaded

    @property
    def empty(self) -> bool:
        return not (self.ran or self.finished)


@dataclass(frozen=True)
class HeldRequest:
    request_id: str
    tokens: int  # tokens whose KV it holds (or will, once its prompt arrives)
    generated: int
    max_tokens: int
    block_ids: tuple[int, ...] = ()  # the blocks it holds now (shared ones count once)
    # whether it owns block_ids (False: a request not admitted yet, its prompt's prefix hits)
    owns: bool = True

    @staticmethod
    def of(req: Request) -> HeldRequest:
        # a migrated request's output counts from its start
        return HeldRequest(
            req.request_id, req.num_tokens, req.output_length, req.output_cap, tuple(req.block_ids)
        )


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int  # new, or to be computed again after a preemption
    parked: int  # preempted, KV in a tier
    preemptions: int  # ever
    recomputed_tokens: int  # ever: KV dropped at preemptions and computed again
    pool: PoolStats
    rotations: int = 0  # ever: parked requests brought back by parking running ones

    @property
    def spilled_bytes(self) -> int:
        return self._tier_sum("spilled_bytes")

    @property
    def reloaded_bytes(self) -> int:
        return self._tier_sum("reloaded_bytes")

    def _tier_sum(self, key: str) -> int:
        if self.pool.offloaded is None:
            return 0
        return sum(t[key] for t in self.pool.offloaded.tiers.values())
