"""The simulator's runner (the Runner protocol of pdserve/engine/runner.py): it computes
nothing, asks a cost model how long the step takes, and samples a made-up token.

Requests in the simulator run to their length (ignore_eos, max_tokens = the workload's
output length), so the token values never steer a decision; they are a pure function of
each sequence's state so that full blocks of different requests hash differently, as real
generated text would."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.engine.batch import RunResult, ScheduledChunk
from pdserve.sim.clock import VirtualClock
from pdserve.sim.cost import CostModel, StepWork


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
        tokens = [
            (c.start * 2654435761 + c.token_ids[-1] * 40503 + len(c.token_ids)) % v
            for c in chunks
            if c.sample
        ]
        return RunResult(tokens)

    def close(self) -> None:
        """Nothing to release."""
