"""scripts/real_repeatability.py: how far the real runs of `bench sim-vs-real` agree with
themselves, from several reports or from one made with --repeat (each point's other real
runs in `repeats`); both give the same analysis of the same runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pdserve.sim.vs_real import compare

SCRIPT = Path(__file__).parent.parent / "scripts" / "real_repeatability.py"


def _script():
    spec = importlib.util.spec_from_file_location("real_repeatability", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REAL = dict(throughput_tok_s=100.0, ttft_p50_s=1.0, tpot_p50_s=0.1, ttft_p99_s=2.0)
REAL.update(tpot_p99_s=0.2, preemptions=10, recomputed_tokens=100, spilled_bytes=0)
REAL.update(num_requests=48)
SETUP = dict(model="m", pool={"num_kv_blocks": 32}, workload={"kind": "reasoning"}, seed=0)
SETUP.update(cluster="1P1D")


def _point(sim: dict, real: dict, repeats=None) -> dict:
    point = {"kind": "cluster", "policy": "greedy+recompute", "concurrency": 8}
    point.update(real=real, sim=sim, misses=compare(sim, real, counts=True)["misses"])
    if repeats is not None:
        point["repeats"] = repeats
    return point


def test_one_report_with_repeats_reads_as_the_reports_of_its_runs():
    rr = _script()
    # TPOT p99 0.2 / 0.5 / 0.35: one figure is within 30% of at most two of them
    runs = [REAL, dict(REAL, tpot_p99_s=0.5), dict(REAL, tpot_p99_s=0.35)]
    sim = dict(REAL, tpot_p99_s=0.4)
    several = [(f"r{i}", {**SETUP, "points": [_point(sim, r)]}) for i, r in enumerate(runs)]
    one = [("r0", {**SETUP, "points": [_point(sim, runs[0], repeats=runs[1:])]})]
    [a], [b] = rr.analyse(several, "cluster"), rr.analyse(one, "cluster")
    assert b["runs"] == ["r0", "r0 (run 2)", "r0 (run 3)"]
    for row in (a, b):
        tpot = row["figures"]["tpot_p99_s"]
        assert tpot["values"] == [0.2, 0.5, 0.35]
        assert tpot["coverage"] == pytest.approx(2 / 3)
        assert row["figures"]["throughput_tok_s"]["coverage"] == 1.0
        assert row["joint_coverage_at_most"] == pytest.approx(2 / 3)
        # the simulated 0.4 misses the first run (2x) only: inside the runs' range
        assert tpot["missed"] == 1 and tpot["missed_inside_real_range"] == 1
        assert row["sim_within"] == pytest.approx(2 / 3)
    assert {k: v for k, v in a.items() if k != "runs"} == {
        k: v for k, v in b.items() if k != "runs"
    }
