"""Cost models: how long one engine step takes, from the plain chunks the scheduler hands a
runner (pdserve/engine/batch.py) and a hardware profile (pdserve/sim/profile.py).

What a step computes, as features:

    seqs                 sequences in the step
    seqs_past_K          max(0, seqs - K) for each knee K in KNEES
    decode_context       sum over decoding sequences of the context each attends to
    prefill_tokens       new prompt tokens
    prefill_attention    sum over prefill chunks of n x (cached + (n + 1) / 2): the
                         (query, key) pairs of causal attention over a cached prefix
    prefill_seqs         prefill chunks (those counted in prefill_tokens): a cost per
                         prefilling sequence whatever its length (on one H200, a prefill
                         step at batch <= 4 ran up to 2x a fit without it)
    prefill_step         1 if the step carries any prefill, else 0: a fixed cost of the
                         prefill path whatever its size. On one H200 (docs/results/gpu/
                         session-1/calibrate-steps.json, refitted) one 128-token prompt's
                         step and four of them cost the same 48-65 ms against 25 ms for a
                         decode step; with this term the refit's small prefill steps came
                         to p90 1.10x (1.53x without, 1.58x with prefill_seqs alone). With
                         CUDA graphs the gap widens (decode-only steps replay a graph,
                         steps with a prefill run eagerly): the next H200 calibration
                         fitted 34.5 ms per such step on a 7.2 ms intercept, median error
                         3.5% (docs/results/gpu/profile.json). Not fitted for a CPU's engine
                         (pdserve/sim/calibrate.py CPU_WITHOUT says why)
    sampled              sequences that sample a token (logits + sampling)

FittedCost:   t = intercept + sum of coefficient x feature, fitted on a real machine by
              `pdserve sim calibrate` (pdserve/sim/calibrate.py)
RooflineCost: t = max(bytes / (bandwidth x e_mem), FLOPs / (rate x e_compute))
                  + TP all-reduces + step overhead + per-sequence overhead
              bytes: the weights the step's tokens touch (all of a dense model; the MoE
              experts some token chose) + every context's KV read once + the new KV written
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.batch import ScheduledChunk
from pdserve.sim.profile import Profile
from pdserve.sim.shape import ModelShape

# the batch past each knee (`seqs_past_K` = max(0, seqs - K)): with non-negative
# coefficients the fitted cost is convex and nondecreasing, piecewise linear in the batch
# size, so a step can stay flat while reading the weights dominates (measured on 2 vCPU:
# 33-40 ms from batch 1 to 8 for SmolLM2) and steepen once the GEMMs turn compute-bound
# (72 ms at 32), where one straight line is low at small batches; the fit picks the knees
KNEES = (4, 8, 16, 32, 64, 128)
FEATURES = (
    "seqs",
    "decode_context",
    "prefill_tokens",
    "prefill_attention",
    "prefill_seqs",
    "prefill_step",
    "sampled",
    *(f"seqs_past_{k}" for k in KNEES),
)


@dataclass(frozen=True)
class StepWork:
    seqs: int
    tokens: int
    decode_context: int
    prefill_tokens: int
    prefill_attention: float
    sampled: int
    context: int  # every sequence's context after the step (KV read once each)
    # chunks counted in prefill_tokens; keyword-only and 0 unless given, so the StepWorks
    # pdserve/sim/calibrate_cluster.py builds by hand (without it) still construct
    prefill_seqs: int = field(default=0, kw_only=True)

    @staticmethod
    def of(chunks: Sequence[ScheduledChunk]) -> StepWork:
        seqs = len(chunks)
        tokens = decode_context = prefill_tokens = prefill_seqs = context = sampled = 0
        prefill_attention = 0.0
        for c in chunks:
            n = len(c.token_ids)
            end = c.start + n
            tokens += n
            context += end
            sampled += c.sample
            if n == 1:
                decode_context += end
            else:
                prefill_tokens += n
                prefill_seqs += 1
                prefill_attention += n * (c.start + (n + 1) / 2)
        return StepWork(
            seqs,
            tokens,
            decode_context,
            prefill_tokens,
            prefill_attention,
            sampled,
            context,
            prefill_seqs=prefill_seqs,
        )

    @property
    def prefill_step(self) -> int:
        return int(self.prefill_tokens > 0)

    def feature(self, name: str) -> float:
        if name.startswith("seqs_past_"):
            return max(0, self.seqs - int(name.removeprefix("seqs_past_")))
        return getattr(self, name)


class CostModel(Protocol):
    def step_seconds(self, work: StepWork) -> float: ...

    def step_bytes(self, work: StepWork) -> float:
        """Device memory bytes the step moves (for bandwidth utilisation; 0 if unknown)."""
        ...


class FittedCost:
    """A feature without a coefficient costs nothing: a profile fitted before the feature
    existed (one without prefill_seqs) loads and predicts as it did."""

    def __init__(self, coefficients: dict[str, float]) -> None:
        unknown = sorted(set(coefficients) - {"intercept", *FEATURES})
        if unknown:
            raise ValueError(f"cost coefficients: unknown feature {unknown[0]!r}")
        self.intercept = coefficients.get("intercept", 0.0)
        self.terms = tuple((f, coefficients[f]) for f in FEATURES if coefficients.get(f))

    def step_seconds(self, work: StepWork) -> float:
        return self.intercept + sum(c * work.feature(f) for f, c in self.terms)

    def step_bytes(self, work: StepWork) -> float:
        return 0.0


class RooflineCost:
    def __init__(self, profile: Profile, shape: ModelShape, fp8_weights: bool = False) -> None:
        if profile.kind != "roofline":
            raise ValueError(f"profile {profile.name}: is {profile.kind}, not a roofline")
        self.p, self.shape = profile, shape
        rate = profile.fp8_flops if fp8_weights and profile.fp8_flops else profile.flops
        self.flops_s = rate * profile.compute_efficiency
        self.bytes_s = profile.memory_bytes_s * profile.memory_efficiency

    def step_bytes(self, work: StepWork) -> float:
        s = self.shape
        return (
            s.weight_bytes_read(work.tokens)
            + s.kv_bytes_per_token * work.context
            + s.kv_bytes_per_token * work.tokens
        )

    def step_flops(self, work: StepWork) -> float:
        s = self.shape
        attention = s.attn_flops_per_context_token * (work.decode_context + work.prefill_attention)
        return s.flops_per_token * work.tokens + attention

    def allreduce_seconds(self, tokens: int) -> float:
        """Two all-reduces per layer of the step's hidden states (ring: 2(k-1)/k of them).
        dp_attention: an all-gather of the group's hidden states before each layer's MLP and
        a reduce-scatter after it, (k-1)/k of the group's tokens each (k x a rank's)."""
        s, p = self.shape, self.p
        if s.tp == 1:
            return 0.0
        nbytes = 2 * (s.tp - 1) / s.tp * tokens * s.group_factor * s.hidden_size * 2
        moved = nbytes / p.interconnect_bytes_s if nbytes else 0.0
        if s.dp_attention:  # the two collectives move one all-reduce's bytes between them
            return s.num_layers * (2 * p.allreduce_latency_s + moved)
        return 2 * s.num_layers * (p.allreduce_latency_s + moved)

    def step_seconds(self, work: StepWork) -> float:
        p = self.p
        memory = self.step_bytes(work) / self.bytes_s
        compute = self.step_flops(work) / self.flops_s
        return (
            max(memory, compute)
            + self.allreduce_seconds(work.tokens)
            + p.step_overhead_s
            + p.per_seq_overhead_s * work.seqs
        )
