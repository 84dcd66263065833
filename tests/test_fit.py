"""The simulator's step-time fit (pdserve/sim/fit.py) and the engine calibration that feeds
it (pdserve/sim/calibrate.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.sim.calibrate import measure_engine
from pdserve.sim.cost import FittedCost, StepWork
from pdserve.sim.fit import fit_steps

TRUE = {"intercept": 0.03, "seqs": 0.0005, "decode_context": 3e-6, "prefill_tokens": 0.001}


def decode(seqs: int, context: int) -> StepWork:
    return StepWork(seqs, seqs, seqs * context, 0, 0.0, seqs, seqs * context)


def prefill(seqs: int, tokens: int, sampled: int) -> StepWork:
    """`seqs` chunks of `tokens` each, `sampled` of them ending their prompts."""
    n = seqs * tokens
    return StepWork(seqs, n, 0, n, seqs * tokens * (tokens + 1) / 2, sampled, n)


def steps() -> list[StepWork]:
    work = [decode(b, c) for b in (1, 2, 4, 8, 16, 32) for c in (32, 256, 1024)]
    return work + [prefill(s, n, k) for s in (1, 4) for n in (16, 64, 256) for k in (0, s)]


def test_noiseless_steps_give_back_the_model_exactly():
    model = FittedCost(TRUE)
    coef, report = fit_steps([(w, model.step_seconds(w)) for w in steps()])
    for name, value in TRUE.items():
        assert coef[name] == pytest.approx(value, rel=1e-6)
    for name in coef.keys() - TRUE.keys():  # a term the model lacks stays at rounding level
        assert coef[name] < 1e-12
    assert report["max_abs_rel_error"] < 1e-6


def test_a_step_flat_to_a_knee_then_rising_is_fitted_piecewise():
    """Flat while the weights' read dominates, then a slope per sequence: the knee terms
    carry it, where one line through both regions would be low at small batches."""
    true = {"intercept": 0.035, "decode_context": 3e-6, "seqs_past_8": 0.0015}
    model = FittedCost(true)
    coef, report = fit_steps([(w, model.step_seconds(w)) for w in steps()])
    assert report["max_abs_rel_error"] < 1e-6
    assert coef["seqs_past_8"] == pytest.approx(0.0015, rel=1e-6)
    fitted = FittedCost(coef)
    assert fitted.step_seconds(decode(2, 256)) == pytest.approx(0.035 + 3e-6 * 512, rel=1e-6)


def test_a_coefficient_the_data_would_make_negative_is_dropped():
    # more sequences make these steps *faster*: no non-negative seqs term can say that
    samples = [(decode(b, 100), 0.05 - 0.0005 * b) for b in range(1, 33)]
    coef, _ = fit_steps(samples)
    assert "seqs" not in coef and all(v > 0 for v in coef.values())


def test_noisy_steps_are_predicted_without_a_low_bias():
    """Multiplicative noise of ±20% around the model: plain relative least squares (weights
    1/measured) predicts these steps ~3% low in total; the reweighted fit is within 1%."""
    rng = np.random.default_rng(0)
    model = FittedCost(TRUE)
    work = steps() * 40
    samples = [(w, model.step_seconds(w) * rng.uniform(0.8, 1.2)) for w in work]
    coef, _ = fit_steps(samples)
    fitted = FittedCost(coef)
    predicted = sum(fitted.step_seconds(w) for w, _ in samples)
    measured = sum(t for _, t in samples)
    assert predicted / measured == pytest.approx(1.0, abs=0.01)
    x = np.array([[1.0, w.seqs, w.decode_context, w.prefill_tokens] for w, _ in samples])
    y = np.array([t for _, t in samples])
    plain, *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
    assert (x @ plain).sum() / measured < 0.985, "the noise must bias the plain fit"


def test_calibration_measures_mixed_and_decode_only_steps_of_every_batch(tmp_path):
    args = EngineArgs(block_size=4, num_kv_blocks=256, enable_prefix_caching=False)
    core, _ = build_engine("tiny-llama", args)
    try:
        samples = measure_engine(core, batches=(1, 3), contexts=(8, 20), outputs=2)
    finally:
        core.close()
    decode_only = {w.seqs for w, _ in samples if w.prefill_tokens == 0}
    mixed = {w.seqs for w, _ in samples if w.prefill_tokens > 0}
    assert {1, 3} <= decode_only and mixed
    long_waves = [w for w, _ in samples if w.prefill_tokens == 0 and w.seqs == 3]
    assert len(long_waves) >= 60, "one wave of 64-token outputs at batch 3 decodes ~63 steps"
    assert all(t > 0 for _, t in samples)
