"""The prefill worker's settings: every timeout and mode, one default each."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.failpoints import NO_FAILPOINTS, Failpoints

KV_PUSH = ("auto", "layerwise", "after")


@dataclass(frozen=True)
class PrefillConfig:
    worker_id: str
    # Push each layer as soon as it is computed, or every layer in one WRITE after the
    # forward pass. "auto" is layer-wise on CUDA, where copy engines and the NIC move bytes
    # while the SMs compute; on CPU the push competes with the forward pass for the same
    # cores and measured no gain, while 30 small WRITEs cost more than one
    # (docs/benchmarks.md, bench transfer).
    kv_push: str = "auto"
    push_timeout_s: float = 30.0  # a request's WRITEs done by then, else it fails alone
    push_poll_s: float = 0.0001
    # how long Prefill waits for its result when the caller set no gRPC deadline (the
    # router always sets one: pdserve/router/config.py prefill_timeout_s)
    default_timeout_s: float = 120.0
    # prefill.accept, prefill.push, prefill.posted (pdserve/failpoints.py)
    failpoints: Failpoints = NO_FAILPOINTS
    # the node's CPU lease (pdserve/serving/cpu_lease.py): a batch's forward pass runs only
    # in its turns; None: this worker's threads have their CPUs to themselves
    cpu_lease: str | None = None
    # under a CPU lease, a batch's turn at the cores lasts about this long (seconds per
    # prompt token learned from the passes run; a lone prompt longer than that goes in parts,
    # a turn each; prefill/turns.py): about the longest wait it puts between two tokens of
    # a decoding request. 0: batches by the token budget alone, a prompt in one pass
    turn_s: float = 0.25

    def __post_init__(self) -> None:
        if self.kv_push not in KV_PUSH:
            raise ValueError(f"kv_push: {self.kv_push!r} is not one of {', '.join(KV_PUSH)}")
        for name in ("push_timeout_s", "push_poll_s", "default_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not (math.isfinite(self.turn_s) and self.turn_s >= 0):
            raise ValueError(
                f"turn_s: must be a finite number >= 0 (0: no bound), got {self.turn_s}"
            )
