"""A request's state inside the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from pdserve.outputs import RequestMetrics
from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # an annotation only: the router's admission imports this without torch
    import torch


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (self.FINISHED_STOPPED, self.FINISHED_LENGTH, self.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # prompt, then every generated token appended
    num_prompt_tokens: int
    params: SamplingParams
    metrics: RequestMetrics
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    max_total_tokens: int  # min(prompt + max_tokens, max_model_len)
    generator: torch.Generator | None = None  # per-request RNG when seeded
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    dropped_tokens: int = 0  # KV dropped by a preemption, not yet computed again
    # its KV stops growing at this many tokens (a move's destination holds no more) until
    # the move ends; None: no bound but max_total_tokens
    hold_at: int | None = None
    # the scheduler step of its last preemption, until it runs again
    preempted_at_step: int | None = None
    # steps it has waited preempted so far (the current wait not included), and the step it
    # last started running (admitted, or brought back): what rotation reads
    stalled_steps: int = 0
    running_since: int = 0
    # prefix caching: the chain hashes of its full blocks (by content, kept across
    # preemptions) and how many leading blocks of block_ids are registered or were hits
    block_hashes: list[int] = field(default_factory=list)
    committed_blocks: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # tokens it generated before this engine held it (a migration's: its prompt ends with
    # them): admission and the length estimator count its output from there
    prior_output_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_length(self) -> int:
        """Its output from its start: here and before this engine held it (a migration's)."""
        return self.prior_output_tokens + self.num_output_tokens

    @property
    def output_cap(self) -> int:
        """The most its output may reach, counted from its start (max_total_tokens is fixed
        at its arrival here; the tokens a migration's Start adds count in both terms)."""
        return self.prior_output_tokens + self.max_total_tokens - self.num_prompt_tokens

    def append_token(self, token: int) -> bool:
        """Append a sampled token -> whether the request finished with it."""
        tokens = self.token_ids
        tokens.append(token)
        if token in self.stop_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if len(tokens) >= self.max_total_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
