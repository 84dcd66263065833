"""What crosses the seam between the scheduler and a runner: plain data, never scheduler
objects. A runner (the real model, or a cost model on a virtual clock) sees only these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # an annotation only: the router's admission imports this without torch
    import torch


class ScheduledChunk(NamedTuple):
    """One request's tokens to compute in one step (a NamedTuple: one is made per request
    per step, and a tuple is the cheapest immutable record to make)."""

    token_ids: list[int]  # the tokens to compute this step
    start: int  # position of token_ids[0] (= tokens already in the cache)
    block_ids: list[int]  # the request's block table
    sample: bool  # the chunk ends the known tokens: sample the next one
    params: SamplingParams
    generator: torch.Generator | None  # the request's own RNG when seeded


@dataclass(frozen=True)
class RunResult:
    """A runner's answer for one step, in chunk order over the chunks that sample."""

    tokens: list[int]
    logprobs: list[dict[int, float]] | None = None  # per sampled token, when asked for
