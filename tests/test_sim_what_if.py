"""scripts/sim_what_if.py: a sim-vs-real report's engine points simulated again with a
profile term changed; as given it reproduces the report's own simulated figures."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from pdserve.sim.profile import load_profile

ROOT = Path(__file__).parent.parent
PROFILE = ROOT / "docs/results/cpu-profile-smollm2-2026-12-07.json"


def _script():
    spec = importlib.util.spec_from_file_location("sim_what_if", ROOT / "scripts/sim_what_if.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_change_names_its_term_and_refuses_bad_ones():
    what_if = _script()
    given = load_profile(str(PROFILE))
    got = what_if.changed(given, ["engine.prefill_step=0", "engine.intercept=0.5"])
    assert got.engine == {**given.engine, "prefill_step": 0.0, "intercept": 0.5}
    assert given.engine["prefill_step"] > 0  # the profile itself untouched
    for bad, match in (
        ("prefill_step=0", "expected engine|cluster|cluster_prefill|handoff|link.TERM=VALUE"),
        ("fitted.intercept=0", "expected engine|cluster|cluster_prefill|handoff|link.TERM"),
        ("engine.intercept", "expected engine|cluster|cluster_prefill|handoff|link.TERM"),
        ("engine.intercept=fast", "'fast' is not a number"),
        ("engine.prefil_step=0", "unknown term 'prefil_step'"),
        ("engine.intercept=-1", "at least 0"),
    ):
        with pytest.raises(ValueError, match=re.escape(match)):
            what_if.changed(given, [bad])


@pytest.mark.parametrize("rescale", [True, False])
def test_as_given_it_reproduces_the_reports_simulated_figures(
    rescale, tmp_path, capsys, monkeypatch
):
    from pdserve.sim.vs_real import bench_sim_vs_real

    profile = load_profile(str(PROFILE))
    report = bench_sim_vs_real(
        "tiny-llama",
        profile,
        concurrencies=(2,),
        policies=("greedy+recompute",),
        num_kv_blocks=16,
        requests=4,
        mean_output=12,
        rescale=rescale,
    )
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    argv = ["sim_what_if.py", str(path), "--profile", str(PROFILE)]
    monkeypatch.setattr("sys.argv", argv + ["--set", "engine.intercept=1.0"])
    assert _script().main() == 0
    out = capsys.readouterr().out
    [point] = report["points"]
    ratios = " ".join(f"{point['ratio'][f]:.2f}" for f in ("throughput_tok_s", "ttft_p50_s"))
    assert f"as given {ratios}" in out
    assert f"({len(point['misses'])} misses) | changed" in out
    # a second per step makes every simulated step far slower: throughput falls
    changed = out.split("| changed ")[1].split()
    assert float(changed[0]) < point["ratio"]["throughput_tok_s"] / 5


def test_the_cluster_terms_are_named_by_their_fields():
    what_if = _script()
    given = load_profile(str(PROFILE))
    got = what_if.changed(given, ["handoff.reserve_s=0.003", "link.latency_s=0.02"])
    assert got.handoff.reserve_s == 0.003 and got.link.latency_s == 0.02
    assert got.handoff.prefill_rpc_s == given.handoff.prefill_rpc_s  # the others as given
    assert got.link.bytes_s == given.link.bytes_s
    got = what_if.changed(given, ["cluster.intercept=0.1", "cluster_prefill.intercept=0"])
    assert got.cluster == {**given.cluster, "intercept": 0.1}
    assert got.cluster_prefill["intercept"] == 0.0
    for bad, match in (
        ("handoff.reserve=0", "unknown term 'reserve'"),
        ("link.intercept=0", "unknown term 'intercept'"),
        ("cluster.reserve_s=0", "unknown term 'reserve_s'"),
    ):
        with pytest.raises(ValueError, match=match):
            what_if.changed(given, [bad])


def test_a_clusters_points_as_given_reproduce_its_report(capsys, monkeypatch):
    """The 2026-12-07 1P1D report (made with --rescale): each cluster point simulated at
    its launched cluster's probe factors gives the report's own ratios; a dearer Start (the
    call after the prefill) makes the 2-client first token later."""
    report = ROOT / "docs/results/sim-vs-real-smollm2-2026-12-07-noprefillstep.json"
    profile = ROOT / "docs/results/cpu-profile-smollm2-2026-12-07-noprefillstep.json"
    argv = ["sim_what_if.py", str(report), "--profile", str(profile), "--kind", "cluster"]
    monkeypatch.setattr("sys.argv", argv + ["--set", "handoff.start_s=0.05"])
    assert _script().main() == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("cluster")]
    points = [p for p in json.loads(report.read_text())["points"] if p["kind"] == "cluster"]
    assert len(lines) == len(points) == 9
    for line, point in zip(lines, points):
        as_given, changed = line.split(" as given ")[1].split(" | changed ")
        fields = ("throughput_tok_s", "ttft_p50_s", "tpot_p50_s", "ttft_p99_s", "tpot_p99_s")
        assert as_given.split()[:5] == [f"{point['ratio'][f]:.2f}" for f in fields]
        if point["concurrency"] == 2:
            assert float(changed.split()[1]) > float(as_given.split()[1]) + 0.1


def test_a_1p2d_reports_decode_steps_are_not_the_1p1d_coefficients(tmp_path, monkeypatch, capsys):
    """cluster.* changes a 1P1D's decode steps; a 1P2D's are the profile's cluster_decodes:
    refused rather than reported as changed. A rescaled cluster point without its probe's
    factors is a clear error."""
    report = json.loads(
        (ROOT / "docs/results/sim-vs-real-smollm2-2026-12-07-noprefillstep.json").read_text()
    )
    profile = ROOT / "docs/results/cpu-profile-smollm2-2026-12-07-noprefillstep.json"
    path = tmp_path / "report.json"
    path.write_text(json.dumps({**report, "cluster": "1P2D"}))
    argv = ["sim_what_if.py", str(path), "--profile", str(profile), "--kind", "cluster"]
    monkeypatch.setattr("sys.argv", argv + ["--set", "cluster.intercept=0"])
    with pytest.raises(SystemExit):
        _script().main()
    assert "decode steps are the profile's cluster_decodes" in capsys.readouterr().err
    path.write_text(json.dumps({**report, "cluster_drift": []}))
    monkeypatch.setattr("sys.argv", argv + ["--set", "handoff.start_s=0"])
    with pytest.raises(ValueError, match="no probe factors"):
        _script().main()
