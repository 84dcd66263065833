"""The simulator's runner (the Runner protocol of pdserve/engine/runner.py): it computes
nothing, asks a cost model how long the step takes, and samples a made-up token.

Requests in the simulator run to their length, so the token values never steer a decision;
they are a pure function of each sequence's state so that full blocks of different requests
hash differently, as real generated text would. A request's length reaches the engine one of
two ways (`request_params`):

- as its `max_tokens` (ignore_eos), the benchmarks' way: a policy that reads max_tokens as a
  cap then knows every request's exact length, which no server does;
- hidden (`pdserve sim --max-tokens CAP`): max_tokens is the cap a client sets, and the
  runner samples a stop token at the request's length, as a model samples EOS, so the
  scheduler learns the length only when the request ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.engine.batch import RunResult, ScheduledChunk
from pdserve.sampling_params import SamplingParams
from pdserve.sim.clock import VirtualClock
from pdserve.sim.cost import CostModel, StepWork


@dataclass(frozen=True)
class HiddenLength(SamplingParams):
    """A simulated request whose length only the runner knows: it samples `stop_token_ids`
    once the sequence holds `ends_at` tokens (its prompt and every output token but the last,
    the one sampled then). A position in the sequence, so it holds across a recompute and a
    migration (whose destination's prompt is the source's context)."""

    ends_at: int = 0


def over_cap(longest: int, cap: int) -> ValueError:
    return ValueError(
        f"max_tokens: a request of the workload generates {longest} tokens, past the cap "
        f"{cap}; give a cap of at least the workload's longest output"
    )


def request_params(
    prompt_tokens: int, output_tokens: int, cap: int | None, vocab_size: int
) -> SamplingParams:
    """A simulated request's parameters: its length as max_tokens (cap None), or hidden
    under max_tokens = cap, ended by the stop token vocab_size - 1 (never sampled otherwise)."""
    if cap is None:
        return SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    if output_tokens > cap:
        raise over_cap(output_tokens, cap)
    return HiddenLength(
        max_tokens=cap,
        temperature=0,
        ignore_eos=True,
        stop_token_ids=(vocab_size - 1,),
        ends_at=prompt_tokens + output_tokens - 1,
    )


class SimRunner:
    def __init__(self, cost: CostModel, clock: VirtualClock, vocab_size: int) -> None:
        self.cost, self.clock, self.vocab = cost, clock, vocab_size
        self.last_seconds = 0.0  # the last step's duration (cost + charged tier moves)
        self.last_bytes = 0.0  # device bytes it moved (0 when the cost model does not say)

    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        on_layer_done: Callable[[int], None] | None = None,
    ) -> RunResult:
        work = StepWork.of(chunks)
        self.last_seconds = self.cost.step_seconds(work) + self.clock.take_charges()
        self.last_bytes = self.cost.step_bytes(work)
        v = self.vocab
        tokens = []
        for c in chunks:
            if not c.sample:
                continue
            token = (c.start * 2654435761 + c.token_ids[-1] * 40503 + len(c.token_ids)) % v
            params = c.params
            if isinstance(params, HiddenLength):
                if c.start + len(c.token_ids) >= params.ends_at:
                    token = v - 1  # the request's last token: its "EOS"
                elif token == v - 1:
                    token = v - 2  # the stop token only where the request ends
            tokens.append(token)
        return RunResult(tokens)

    def close(self) -> None:
        """Nothing to release."""
