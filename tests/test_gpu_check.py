"""scripts/gpu-check.sh, dry-run on this CPU: every section runs with a tiny model and small
sizes, writes its JSON and reports its exit status, so that the GPU session's one run is
known to work before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def dry_run(results, **env) -> str:
    """scripts/gpu-check.sh in its CPU dry run, results under `results` -> its log."""
    env = dict(
        os.environ, GPU_CHECK_DRY_RUN="1", RESULTS=str(results), PYTHON=sys.executable, **env
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return (results / "gpu-check.log").read_text()


def test_the_gpu_check_runs_every_section_on_a_cpu(tmp_path):
    log = dry_run(tmp_path)
    assert "== bench preempt-cost (tiny-llama): exit 0" in log, log
    assert "== kernel and CUDA graph tests (-m gpu): exit" in log  # skipped without CUDA
    cost = json.loads((tmp_path / "preempt-cost.json").read_text())
    assert [r["context"] for r in cost["rows"]] == [64, 256]
    assert all(r["decode_step_s"] > 0 and r["recompute_s"] > 0 for r in cost["rows"])
    assert "== bench sweep (tiny-llama): exit 0" in log, log
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    policies = {p["policy"] for p in sweep["points"]}
    assert policies == {"greedy+recompute", "greedy+tiered", "default"}
    assert all(p["errors"] == 0 and "goodput_req_s" in p for p in sweep["points"])
    assert "== bench roofline (tiny-llama): exit 0" in log, log
    assert "== sim calibrate (tiny-llama): exit 0" in log, log
    profile = json.loads((tmp_path / "profile.json").read_text())
    steps = json.loads((tmp_path / "calibrate-steps.json").read_text())["steps"]
    assert profile["kind"] == "fitted" and profile["fit"]["engine"]["steps"] == len(steps)
    assert "== bench sim-vs-real (tiny-llama): exit 0" in log, log
    vs_real = json.loads((tmp_path / "sim-vs-real.json").read_text())
    assert len(vs_real["points"]) == 3 * 2  # three policies x two concurrencies
    assert "== bench tiers (tiny-llama): exit 0" in log, log
    tiers = json.loads((tmp_path / "tiers.json").read_text())
    assert (tiers["device"], tiers["dtype"]) == ("cpu", "bfloat16")
    assert all(r["bit_exact"] for r in tiers["rows"])


def test_the_gpu_check_reruns_only_the_sections_asked_for(tmp_path):
    log = dry_run(tmp_path, GPU_CHECK_ONLY="roofline")
    assert "== bench roofline (tiny-llama): exit 0" in log, log
    not_asked = [line for line in log.splitlines() if line.endswith(": not in GPU_CHECK_ONLY")]
    for section in (
        "kernel and CUDA graph tests",
        "bench preempt-cost",
        "sim calibrate",
        "bench tiers",
        "bench sweep",
    ):
        assert any(line.startswith(f"== {section}") for line in not_asked), log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-check.log", "roofline.json"]


def test_the_gpu_check_tiers_section_alone(tmp_path):
    """The spill tiers on the CPU in bf16 (the GPU run's dtype): every tier and layout, each
    reload bit-exact; GB/s and fractions of raw for each."""
    log = dry_run(tmp_path, GPU_CHECK_ONLY="tiers")
    assert "== bench tiers (tiny-llama): exit 0" in log, log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-check.log", "tiers.json"]
    report = json.loads((tmp_path / "tiers.json").read_text())
    assert (report["device"], report["dtype"]) == ("cpu", "bfloat16")
    rows = report["rows"]
    assert {(r["tier"], r["layout"]) for r in rows} == {
        (t, layout) for t in ("host", "cxl", "disk") for layout in ("run", "scattered")
    }
    for r in rows:
        assert r["bit_exact"] and r["spill_gb_s"] > 0 and r["reload_gb_s"] > 0
        assert r["spill_fraction_of_raw"] > 0 and r["reload_fraction_of_raw"] > 0
