"""The runner seam: the engine core hands a runner plain chunks and gets tokens back.

`ModelRunner` (pdserve/engine/model_runner.py) runs the model on the KV pool; a simulator's
runner can advance a virtual clock from a cost model instead, and the scheduler, allocator
and policies above it make the same decisions either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from pdserve.engine.batch import RunResult, ScheduledChunk


class Runner(Protocol):
    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        on_layer_done: Callable[[int], None] | None = None,
    ) -> RunResult:
        """Compute the chunks (their KV lands in the pool) and sample one token for each
        chunk with `sample` set. `on_layer_done(i)` is called once layer i's KV is in the
        pool (the prefill worker pushes it from there)."""
        ...

    def close(self) -> None:
        """Release what the runner started (a tensor-parallel group's other ranks)."""
        ...
