"""What the engine returns for a request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() seconds
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
    preemptions: int = 0
    recomputed_tokens: int = 0  # KV dropped at preemptions and computed again
    spills: int = 0  # preemptions whose KV went to a spill tier (and came back)

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "length" | "stop"
    metrics: RequestMetrics
    # per generated token: {token id: log-probability} of the top `logprobs` tokens
    logprobs: list[dict[int, float]] = field(default_factory=list)
