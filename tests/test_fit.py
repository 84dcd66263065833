"""The simulator's step-time fit (pdserve/sim/fit.py) and the engine calibration that feeds
it (pdserve/sim/calibrate.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.args import EngineArgs
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.build import build_engine
from pdserve.sampling_params import SamplingParams
from pdserve.sim.calibrate import measure_engine, measure_tiers, tier_costs
from pdserve.sim.cost import FittedCost, StepWork
from pdserve.sim.fit import fit_steps
from pdserve.sim.profile import PROFILE_DIR, load_profile

TRUE = {"intercept": 0.03, "seqs": 0.0005, "decode_context": 3e-6, "prefill_tokens": 0.001}
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def decode(seqs: int, context: int) -> StepWork:
    return StepWork(seqs, seqs, seqs * context, 0, 0.0, seqs, seqs * context)


def prefill(seqs: int, tokens: int, sampled: int) -> StepWork:
    """`seqs` chunks of `tokens` each, `sampled` of them ending their prompts."""
    n = seqs * tokens
    attention = seqs * tokens * (tokens + 1) / 2
    return StepWork(seqs, n, 0, n, attention, sampled, n, prefill_seqs=seqs)


def steps() -> list[StepWork]:
    work = [decode(b, c) for b in (1, 2, 4, 8, 16, 32) for c in (32, 256, 1024)]
    return work + [prefill(s, n, k) for s in (1, 4) for n in (16, 64, 256) for k in (0, s)]


def chunk(tokens: int, start: int, sample: bool) -> ScheduledChunk:
    blocks = list(range(-(-(start + tokens) // 4)))
    return ScheduledChunk([7] * tokens, start, blocks, sample, SamplingParams(), None)


def test_step_work_counts_each_prefill_chunk_once_and_decodes_apart():
    work = StepWork.of(
        [
            chunk(5, 0, True),  # a whole 5-token prompt: samples
            chunk(3, 8, False),  # a prompt's middle chunk over 8 cached tokens: no sample
            chunk(1, 20, True),  # decodes: context 21 and 7
            chunk(1, 6, True),
        ]
    )
    assert work == StepWork(
        seqs=4,
        tokens=10,
        decode_context=21 + 7,
        prefill_tokens=5 + 3,
        prefill_attention=5 * (0 + 6 / 2) + 3 * (8 + 4 / 2),  # n x (cached + (n + 1) / 2)
        sampled=3,
        context=5 + 11 + 21 + 7,
        prefill_seqs=2,
    )
    assert work.feature("prefill_seqs") == 2 and work.feature("seqs_past_4") == 0
    assert work.feature("prefill_step") == 1
    assert StepWork.of([chunk(1, 20, True)]).feature("prefill_step") == 0


def test_noiseless_steps_give_back_the_model_exactly():
    model = FittedCost(TRUE)
    coef, report = fit_steps([(w, model.step_seconds(w)) for w in steps()])
    for name, value in TRUE.items():
        assert coef[name] == pytest.approx(value, rel=1e-6)
    for name in coef.keys() - TRUE.keys():  # a term the model lacks stays at rounding level
        assert coef[name] < 1e-12
    assert report["max_abs_rel_error"] < 1e-6


def test_a_cost_per_prefilling_sequence_is_told_from_the_tokens_and_the_step():
    """A fixed step, costs per prefill token and attention pair of the H200 fit's size
    (docs/simulator.md), 4 ms per prefilling sequence and 20 ms per step with a prefill. The
    steps hold the same prefill tokens as 1 and as 4 sequences (64 as 1 x 64 and 4 x 16), as
    calibration measures them (pdserve/sim/calibrate.py PREFILL_SPLITS); each term comes back
    within 1%."""
    true = {
        "intercept": 0.028,
        "seqs": 0.0003,
        "decode_context": 2e-7,
        "prefill_tokens": 1.2e-5,
        "prefill_attention": 7e-8,
        "prefill_seqs": 0.004,
        "prefill_step": 0.02,
    }
    model = FittedCost(true)
    work = steps()
    assert {(w.prefill_tokens, w.prefill_seqs) for w in work} >= {(64, 1), (64, 4)}
    coef, report = fit_steps([(w, model.step_seconds(w)) for w in work])
    assert report["max_abs_rel_error"] < 1e-6
    for name, value in true.items():
        assert coef[name] == pytest.approx(value, rel=0.01)
    for name in coef.keys() - true.keys():
        assert coef[name] < 1e-12


def test_profiles_fitted_before_prefill_seqs_load_and_predict_as_before():
    """Every fitted profile committed loads; one fitted before the prefill_seqs feature (no
    such coefficient) predicts the same whatever the number of prefilling sequences, and at
    least one fitted since has the term."""
    paths = [
        *RESULTS.glob("*.json"),
        *RESULTS.glob("gpu/*.json"),
        *RESULTS.glob("gpu/session-1/*.json"),
        *PROFILE_DIR.glob("*.json"),
    ]
    fitted = [p for p in paths if json.loads(p.read_text()).get("kind") == "fitted"]
    assert len(fitted) >= 5, "docs/results holds CPU and GPU profiles fitted by calibrate"
    work = StepWork.of([chunk(5, 0, True), chunk(3, 8, False), chunk(1, 20, True)])
    alone = dataclasses.replace(work, prefill_seqs=0)
    before = since = 0
    for path in fitted:
        profile = load_profile(str(path))
        for coefficients in (profile.engine, profile.cluster, profile.cluster_prefill):
            cost = FittedCost(coefficients)
            if "prefill_seqs" in coefficients:
                since += 1
                assert cost.step_seconds(work) > cost.step_seconds(alone)
            else:
                before += 1
                assert cost.step_seconds(work) == cost.step_seconds(alone)
        assert FittedCost(profile.engine).step_seconds(work) > 0
    assert before >= 4 and since >= 1


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


@pytest.fixture(scope="module")
def calibration() -> list[tuple[StepWork, float]]:
    """The grid of batches 1 and 3 over prompts of 8 and 20 tokens, on tiny-llama."""
    args = EngineArgs(block_size=4, num_kv_blocks=256, enable_prefix_caching=False)
    core, _ = build_engine("tiny-llama", args)
    try:
        return measure_engine(core, batches=(1, 3), contexts=(8, 20), outputs=2)
    finally:
        core.close()


def test_calibration_measures_mixed_and_decode_only_steps_of_every_batch(calibration):
    samples = calibration
    decode_only = {w.seqs for w, _ in samples if w.prefill_tokens == 0}
    mixed = {w.seqs for w, _ in samples if w.prefill_tokens > 0}
    assert {1, 3} <= decode_only and mixed
    long_waves = [w for w, _ in samples if w.prefill_tokens == 0 and w.seqs == 3]
    assert len(long_waves) >= 60, "one wave of 64-token outputs at batch 3 decodes ~63 steps"
    assert all(t > 0 for _, t in samples)


def test_calibration_measures_each_context_as_1_and_2_prefilling_sequences(calibration):
    """Batches 1 and 3 over 8 and 20 tokens: no two main-grid points share a prefill total
    (8, 20, 24, 60), so the split waves alone measure one total as several sequences: two
    one-step waves each of 1 x 8 and 2 x 4, 1 x 20 and 2 x 10 (4-way splits need batch 4)."""
    prefill_only = [w for w, _ in calibration if w.prefill_seqs and not w.decode_context]
    shapes = [(w.prefill_tokens, w.prefill_seqs) for w in prefill_only]
    for total in (8, 20):
        assert shapes.count((total, 1)) >= 2 and shapes.count((total, 2)) == 2
    assert not any(k == 4 for _, k in shapes)
    assert all(w.seqs == w.prefill_seqs == w.sampled for w in prefill_only)


def test_a_tier_costs_the_line_through_its_two_sizes_and_noise_never_makes_it_free():
    block = 1 << 20
    # 1 block in 1.1 ms, 32 in 4.2 ms: 31 MiB in 3.1 ms, 1 ms of it fixed
    latency, rate = tier_costs(0.0011, 0.0042, block, 32)
    assert rate == pytest.approx(31 * block / 0.0031)
    assert latency == pytest.approx(0.0011 - block / rate)
    # the single block no faster than the 32, or nearly as slow (a noisy machine): not a
    # fixed cost at a near-infinite rate, but what the big copy took
    for many in (0.0079, 0.0080):
        latency, rate = tier_costs(0.0079, many, block, 32)
        assert latency == 0.0 and rate == pytest.approx(32 * block / many)


def test_calibration_measures_every_tier_at_a_finite_rate(tmp_path):
    args = EngineArgs(num_kv_blocks=64, block_size=16, spill_dir=str(tmp_path), preemption="tiered")
    core, _ = build_engine("tiny-llama", args)
    try:
        tiers = measure_tiers(core, args, reps=2)
    finally:
        core.close()
    assert set(tiers) == {"host", "cxl", "disk"}
    for costs in tiers.values():
        assert 0 < costs["spill_bytes_s"] < 1e13 and 0 < costs["reload_bytes_s"] < 1e13
        assert costs["latency_s"] >= 0


def test_a_feature_left_out_gets_no_coefficient_and_the_rest_take_its_share():
    """fit_steps(without=...): the prefill_step term of steps generated with one comes back
    spread over the others (no coefficient of its own); steps generated without it come back
    exactly; an unknown feature is refused."""
    true = {"intercept": 0.028, "prefill_tokens": 1.2e-5, "prefill_step": 0.02, "seqs": 3e-4}
    model = FittedCost(true)
    samples = [(w, model.step_seconds(w)) for w in steps()]
    coef, _ = fit_steps(samples, without=("prefill_step",))
    assert "prefill_step" not in coef
    assert coef["intercept"] > true["intercept"] or coef["prefill_tokens"] > 1.2e-5
    plain = FittedCost({k: v for k, v in true.items() if k != "prefill_step"})
    coef, report = fit_steps([(w, plain.step_seconds(w)) for w in steps()], ("prefill_step",))
    assert "prefill_step" not in coef and report["max_abs_rel_error"] < 1e-6
    with pytest.raises(ValueError, match="unknown feature 'warp'"):
        fit_steps(samples, without=("warp",))


def test_calibration_on_a_cpu_leaves_prefill_step_out_and_says_so(monkeypatch):
    """The engine's steps measured on a CPU are fitted without prefill_step (a GPU's fixed
    cost, pdserve/sim/calibrate.py CPU_WITHOUT); the profile names what it left out."""
    import torch

    from pdserve.sim import calibrate

    if torch.cuda.is_available():
        pytest.skip("calibrate builds its engine on the GPU here (prefill_step is fitted)")
    model = FittedCost({"intercept": 0.03, "prefill_tokens": 1e-3, "prefill_step": 0.03})
    measured = [(w, model.step_seconds(w)) for w in steps()]
    monkeypatch.setattr(calibrate, "measure_engine", lambda core, **kw: measured)
    profile = calibrate.calibrate("tiny-llama", num_kv_blocks=256)
    assert "prefill_step" not in profile["engine"]
    assert profile["fit"]["engine"]["left_out"] == ["prefill_step"]
    assert "not fitted on cpu: prefill_step" in profile["sources"]["engine"]
