"""A decode worker's steps cost what they were measured to cost with as many decode workers
on the node: a launched 1P2D splits the CPUs between its decode workers (pdserve/launch.py),
so `sim calibrate --cluster` fits 1P2D's steps apart (`cluster_decodes`) and the simulated
1P2D uses them (pdserve/sim/profile.py Profile.cluster_decode)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.bench.workload import specs_of
from pdserve.engine.args import EngineArgs
from pdserve.sim import fit
from pdserve.sim.calibrate_cluster import _steps, check_decodes
from pdserve.sim.profile import load_profile, per_seq_term, profile_from_dict
from pdserve.sim.run import RECOMPUTE_TERMS, Setup, Topology, simulate
from pdserve.weights import model_config

CPU_PROFILE = Path(__file__).parent.parent / "docs/results/cpu-profile-smollm2-2026-12-04.json"
# what format_table needs of a report with no points
EMPTY_REPORT = {
    "model": "m",
    "profile": "p",
    "pool": {"num_kv_blocks": 16},
    "points": [],
    "misses": 0,
}


def _profile(**decodes):
    base = load_profile(str(CPU_PROFILE))
    raw = {k: dict(v) for k, v in decodes.items()}
    return dataclasses.replace(base, cluster_decodes=raw)


def test_the_coefficients_of_the_largest_count_measured_up_to_the_topologys():
    one = load_profile(str(CPU_PROFILE)).cluster
    two = {k: 2 * v for k, v in one.items()}
    four = {k: 4 * v for k, v in one.items()}
    p = _profile(**{"2": two, "4": four})
    assert p.cluster_decode(1) == one
    assert p.cluster_decode(2) == two and p.cluster_decode(3) == two
    assert p.cluster_decode(4) == four and p.cluster_decode(8) == four
    assert _profile().cluster_decode(2) == one  # none measured: 1P1D's


@pytest.mark.parametrize(
    "bad",
    [
        {"1": {"seqs": 1.0}},
        {"two": {"seqs": 1.0}},
        {"0": {"seqs": 1.0}},
        {"02": {"seqs": 1.0}},
        {"2": 0.5},
        {"2": {}},
        {"2": {"warp_speed": 1.0}},
        None,
        [],
    ],
)
def test_the_profile_field_is_checked(bad):
    raw = dataclasses.asdict(load_profile(str(CPU_PROFILE)))
    with pytest.raises(ValueError, match="cluster_decodes"):
        profile_from_dict({**raw, "cluster_decodes": bad})


@pytest.mark.parametrize("decodes", [(2,), (0, 1), ()])
def test_calibration_needs_1p1d(decodes):
    with pytest.raises(ValueError, match="cluster decodes"):
        check_decodes(decodes)
    check_decodes((1, 2))


def _point(profile, decode: int, seed: int = 1) -> dict:
    specs = specs_of("reasoning", 48, seed=seed, mean_output=30, max_output=60)
    setup = Setup(
        model_config("tiny-llama"),
        profile,
        Topology(prefill=1, decode=decode),
        EngineArgs(block_size=4, num_kv_blocks=200),
    )
    return simulate(setup, "greedy+recompute", specs, concurrency=16, label="")


def test_a_simulated_1p2d_steps_at_its_own_cost_and_1p1d_at_its():
    """Decode steps twice as dear at 2 decode workers: 1P2D's TPOT rises, nearly
    doubling, its tokens the same; 1P1D is untouched."""
    one = load_profile(str(CPU_PROFILE)).cluster
    dear = _profile(**{"2": {k: 2 * v for k, v in one.items()}})
    for decode in (1, 2):
        plain, other = _point(_profile(), decode), _point(dear, decode)
        assert plain["generated_tokens"] == other["generated_tokens"]
        if decode == 1:  # the same run, but how long the simulator itself took
            wall = ("wall_s", "sim_steps_per_s")
            assert {k: v for k, v in other.items() if k not in wall} == {
                k: v for k, v in plain.items() if k not in wall
            }
        else:
            assert 1.5 < other["tpot_p50_s"] / plain["tpot_p50_s"] < 2.1


def _span(name, worker, start, end):
    return {"name": name, "worker": worker, "start": start, "end": end}


def test_calibration_reads_each_decode_workers_steps_on_its_own_clock():
    """Two decode workers stepping side by side: a step's cost is the cycle to that
    worker's next step, not to the other worker's."""
    traces = []
    for worker, offset, n in (("decode-a", 0.0, 2), ("decode-b", 0.004, 1)):
        for r in range(n):  # n requests sharing every step of the worker
            spans = [
                _span("decode.step", worker, offset + 0.01 * k, offset + 0.01 * k + 0.008)
                for k in range(3)
            ]
            traces.append({"spans": spans, "prompt_tokens": 10 + r})
    decode, prefill = _steps(traces)
    assert not prefill
    assert len(decode) == 6
    by_batch = sorted((w.seqs, round(s, 6)) for w, s in decode)
    # back to back: each step is its 10 ms cycle, the last one its own 8 ms
    assert by_batch == [(1, 0.008), (1, 0.01), (1, 0.01), (2, 0.008), (2, 0.01), (2, 0.01)]


def test_sim_vs_real_compares_a_1p2d_cluster_with_the_simulated_1p2d(monkeypatch):
    """`bench sim-vs-real --cluster --decode-workers 2 --no-engine --rescale`: a launched
    1P2D cluster, probed before its points, against the simulated 1P2D, whose decode steps
    cost what the profile's cluster_decodes says for 2 times the probe's factor (and, beside
    it, as given), the same requests on both sides."""
    from pdserve import launch
    from pdserve.sim import vs_cluster, vs_real
    from pdserve.sim.vs_real import bench_sim_vs_real, format_table

    if not launch.computes_on_cpu([]):
        pytest.skip("a launched cluster takes turns at the CPUs only when it computes on them")
    launched, decode_costs = [], []
    real_cluster, real_simulate = launch.Cluster, vs_real.simulate

    def cluster(model, prefill, decode, **kwargs):
        launched.append((prefill, decode))
        return real_cluster(model, prefill, decode, **kwargs)

    def simulate_(setup, *args, **kwargs):
        decode_costs.append((setup.topology.decode, setup.cost("decode"), setup.cost("prefill")))
        handoffs.append((setup.profile.handoff, setup.profile.link))
        return real_simulate(setup, *args, **kwargs)

    handoffs = []
    monkeypatch.setattr(launch, "Cluster", cluster)
    monkeypatch.setattr(vs_real, "simulate", simulate_)
    shared = load_profile(
        str(
            Path(__file__).parent.parent / "docs/results/cpu-profile-smollm2-2026-12-05-shared.json"
        )
    )
    assert shared.shares_cpus, "the committed profile was measured in turns"
    two = {k: 1.5 * v for k, v in shared.cluster.items()}  # 1P2D's own steps
    profile = dataclasses.replace(shared, cluster_decodes={"2": two})
    report = bench_sim_vs_real(
        "tiny-llama",
        profile,
        concurrencies=(4,),
        policies=("greedy+recompute",),
        num_kv_blocks=32,
        requests=8,
        mean_output=16,
        cluster=True,
        decode_workers=2,
        engine=False,
        rescale=True,
    )
    assert launched == [(1, 2)]
    [probe] = report["cluster_drift"]
    assert probe["policy"] == "greedy+recompute" and report["drift"] is None  # no engine
    assert probe["decode"]["steps"] >= 128  # each load's requests decode 64 tokens, 2 a client
    assert probe["prefill"]["steps"] >= vs_cluster.MIN_PREFILLS
    x, y = probe["factors"]["decode"], probe["factors"]["prefill"]
    # the probe's batches of 2 x 12 one-block requests split its decode factor in two where
    # enough steps of 8+ sequences came back (tiny-llama's requests may end before the
    # batch fills: then one factor, the median)
    split = probe["split"]
    if split is None:
        xs = x
        assert "decode_per_seq" not in probe["factors"]
        assert x == probe["decode"]["measured_over_profile"]
    else:
        assert split["large"]["steps"] >= fit.MIN_GROUP
        xs = probe["factors"]["decode_per_seq"]
        assert (x, xs) == (split["base"], split["per_seq"])
    assert probe["decode"]["measured_over_profile"] != pytest.approx(1.0, abs=0.05)
    assert y == probe["prefill"]["measured_over_profile"] != pytest.approx(1.0, abs=0.05)
    # the point simulated scaled, then as given
    (decodes, scaled, scaled_prefill), (_, given, given_prefill) = decode_costs
    measured = shared.cluster_prefill
    # a decode worker's recompute chunks cost the engine's prefill terms, at the decode
    # worker's speed (its intercept over the engine's, scaled with it under --rescale)
    recompute = {f: c for f, c in shared.engine.items() if f in RECOMPUTE_TERMS}
    assert recompute and not set(recompute) & set(two)
    slower = two["intercept"] / shared.engine["intercept"]
    for cost, coefficients, factor, per_seq, more in (
        (scaled, two, x, xs, {f: x * slower * c for f, c in recompute.items()}),
        (given, two, 1.0, 1.0, {f: slower * c for f, c in recompute.items()}),
        (scaled_prefill, measured, y, y, {}),
        (given_prefill, measured, 1.0, 1.0, {}),
    ):
        assert decodes == 2
        assert cost.intercept == pytest.approx(factor * coefficients.get("intercept", 0.0))
        assert dict(cost.terms) == pytest.approx(
            {
                f: (per_seq if per_seq_term(f) else factor) * c
                for f, c in coefficients.items()
                if f != "intercept" and c
            }
            | more
        )
    table = format_table(report)
    assert report["cluster"] == "1P2D" and "cluster 1P2D" in table
    assert f"prefill {y:.2f}x" in table
    if split is not None:
        assert f"split {x:.2f}x whatever the batch, {xs:.2f}x per sequence" in table
    # the handoff and the link as measured, scaled or not
    assert handoffs == [(shared.handoff, shared.link)] * 2
    assert probe["preemptions"] >= 0
    assert "the cluster's step costs scaled" in table  # --no-engine
    [point] = report["points"]
    assert point["kind"] == "cluster" and point["concurrency"] == 4
    assert point["real"]["generated_tokens"] == point["sim"]["generated_tokens"] > 0
    assert point["unscaled"]["sim"]["generated_tokens"] == point["sim"]["generated_tokens"]
    assert point["real"]["errors"] == 0


def test_sim_vs_real_refuses_what_it_cannot_compare():
    from pdserve.sim.vs_cluster import cluster_points
    from pdserve.sim.vs_real import Comparison, bench_sim_vs_real

    profile = load_profile(str(CPU_PROFILE))
    with pytest.raises(ValueError, match="nothing to compare"):
        bench_sim_vs_real("tiny-llama", profile, engine=False)
    with pytest.raises(ValueError, match="decode_workers"):
        bench_sim_vs_real("tiny-llama", profile, cluster=True, decode_workers=0)
    with pytest.raises(ValueError, match="with --cluster"):
        bench_sim_vs_real("tiny-llama", profile, decode_workers=2)
    # a profile with no 1P2D steps measured is not compared with a 1P2D cluster
    cmp = Comparison("tiny-llama", profile, ("greedy+recompute",), (2,), 16, 4, 8, 16, 0, "", 2)
    with pytest.raises(ValueError, match="no decode steps measured with 2 decode workers"):
        cluster_points(cmp)


def test_the_cli_refuses_cluster_decodes_it_would_not_measure(tmp_path, capsys):
    from pdserve.cli import main

    out = str(tmp_path / "p.json")
    base = ["sim", "calibrate", "--model", "tiny-llama", "--json", out]
    assert main([*base, "--cluster-decodes", "1,3"]) == 2  # without --cluster
    assert "give --cluster" in capsys.readouterr().err
    assert main([*base, "--cluster", "--cluster-decodes", "2"]) == 2  # no 1P1D
    assert "cluster decodes: 1 and any larger" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()  # refused before anything was measured


def test_the_comparison_says_how_far_the_machine_drifted_from_its_profile(monkeypatch):
    """A probe of the real engine before the runs: measured over predicted step time, and a
    line saying the profile is stale past 10%. Here the profile's coefficients halved: the
    same machine reads twice as slow against them as against the profile itself."""
    from pdserve.sim import calibrate
    from pdserve.sim.vs_real import Comparison, engine_drift, format_table

    profile = load_profile(str(CPU_PROFILE))
    calls = []
    real_measure = calibrate.measure_engine

    def measure(core, **kwargs):
        if not calls:
            calls.append(real_measure(core, **kwargs))
        return calls[0]  # the same steps for both profiles

    monkeypatch.setattr(calibrate, "measure_engine", measure)
    half = dataclasses.replace(profile, engine={k: v / 2 for k, v in profile.engine.items()})
    drifts = []
    for p in (profile, half):
        cmp = Comparison("tiny-llama", p, ("greedy+recompute",), (2,), 16, 4, 8, 16, 0, "")
        drifts.append(engine_drift(cmp))
    assert drifts[0]["steps"] == drifts[1]["steps"] >= 100
    x = drifts[0]["measured_over_profile"]
    assert drifts[1]["measured_over_profile"] == pytest.approx(2 * x)
    report = dict(EMPTY_REPORT)
    fresh = format_table({**report, "drift": {"measured_over_profile": 1.05, "steps": 150}})
    stale = format_table({**report, "drift": {"measured_over_profile": 1.3, "steps": 150}})
    assert "1.05x the profile's time" in fresh and "stale" not in fresh
    assert "1.30x the profile's time" in stale and "the profile is stale" in stale
    assert "in a probe before the runs" in fresh  # a report from before the per-policy probes
    probes = [{"policy": "a", "measured_over_profile": 0.97, "steps": 118}]
    probes.append({"policy": "b", "measured_over_profile": 0.8, "steps": 118})
    lines = format_table({**report, "drift": probes}).splitlines()
    [a] = [x for x in lines if "before its a points" in x]
    [b] = [x for x in lines if "before its b points" in x]
    assert "0.97x" in a and "stale" not in a and "0.80x" in b and "stale" in b
    probes.append({"policy": None, "measured_over_profile": 1.02, "steps": 118})
    lines = format_table({**report, "drift": probes}).splitlines()
    [end] = [x for x in lines if "after the last points" in x]
    assert "1.02x" in end
    roofline = dataclasses.replace(profile, kind="roofline", memory_bytes_s=1.0, flops=1.0)
    cmp = Comparison("tiny-llama", roofline, ("greedy+recompute",), (2,), 16, 4, 8, 16, 0, "")
    assert engine_drift(cmp) is None


def test_rescale_simulates_the_profile_scaled_by_the_probe_and_as_given():
    """`--rescale`: every step cost times the probe's factor; the profile as given is
    simulated too, and on the engine (no other costs on its clock) the two runs differ by
    exactly that factor in time."""
    from pdserve.sim.vs_real import bench_sim_vs_real, format_table

    report = bench_sim_vs_real(
        "tiny-llama",
        load_profile(str(CPU_PROFILE)),
        concurrencies=(2,),
        policies=("greedy+recompute",),
        num_kv_blocks=16,
        requests=4,
        mean_output=8,
        rescale=True,
    )
    first, last = report["drift"]  # before the points and after them
    assert (first["policy"], last["policy"]) == ("greedy+recompute", None)
    assert first["steps"] >= 100 and last["steps"] >= 100
    [point] = report["points"]
    factor = point["engine_factor"]
    x0, x1 = first["measured_over_profile"], last["measured_over_profile"]
    assert min(x0, x1) <= factor <= max(x0, x1)
    scaled, raw = point["sim"], point["unscaled"]["sim"]
    assert (
        scaled["generated_tokens"] == raw["generated_tokens"] == point["real"]["generated_tokens"]
    )
    assert scaled["tpot_p50_s"] == pytest.approx(factor * raw["tpot_p50_s"], rel=1e-6)
    assert scaled["throughput_tok_s"] == pytest.approx(raw["throughput_tok_s"] / factor, rel=1e-6)
    assert report["rescaled"] and report["misses_unscaled"] == len(point["unscaled"]["misses"])
    assert "--rescale" in format_table(report)


def test_the_engine_is_probed_around_each_policys_points(monkeypatch):
    """The engine half probes the machine before the first policy's points, between two
    policies (after one's engine is closed, before the next is built) and after the last;
    --rescale scales each point by the probes' factor interpolated at its time."""
    from pdserve.sim import vs_real

    events, factors = [], iter((1.5, 3.0, 4.5))
    real_build = vs_real.build_engine

    def probe(cmp):
        events.append("probe")
        return {"measured_over_profile": next(factors), "steps": 120}

    def build(model, args):
        events.append("engine")
        core, rest = real_build(model, args)
        close = core.close

        def closed():
            events.append("closed")
            close()

        core.close = closed
        return core, rest

    monkeypatch.setattr(vs_real, "engine_drift", probe)
    monkeypatch.setattr(vs_real, "build_engine", build)
    report = vs_real.bench_sim_vs_real(
        "tiny-llama",
        load_profile(str(CPU_PROFILE)),
        concurrencies=(2,),
        policies=("greedy+recompute", "greedy+tiered"),
        num_kv_blocks=16,
        requests=4,
        mean_output=8,
        rescale=True,
    )
    assert events == ["probe", "engine", "closed", "probe", "engine", "closed", "probe"]
    probes = report["drift"]
    assert [(p["policy"], p["measured_over_profile"]) for p in probes] == [
        ("greedy+recompute", 1.5),
        ("greedy+tiered", 3.0),
        (None, 4.5),
    ]
    assert probes[0]["at_s"] < probes[1]["at_s"] < probes[2]["at_s"]
    for point, (b, a) in zip(report["points"], zip(probes, probes[1:]), strict=True):
        assert b["at_s"] < point["at_s"] < a["at_s"]
        frac = (point["at_s"] - b["at_s"]) / (a["at_s"] - b["at_s"])
        factor = point["engine_factor"]
        x0, x1 = b["measured_over_profile"], a["measured_over_profile"]
        assert factor == pytest.approx(x0 + frac * (x1 - x0)) and x0 < factor < x1
        raw = point["unscaled"]["sim"]
        assert point["sim"]["tpot_p50_s"] == pytest.approx(factor * raw["tpot_p50_s"], rel=1e-6)


def test_a_factor_between_two_probes():
    from pdserve.sim.vs_real import between

    b = {"measured_over_profile": 1.0, "at_s": 10.0}
    a = {"measured_over_profile": 2.0, "at_s": 30.0}
    assert between(b, a, 15.0) == pytest.approx(1.25)
    assert between(b, a, 5.0) == 1.0 and between(b, a, 40.0) == 2.0  # held at the ends
    assert between(b, {**a, "at_s": 10.0}, 20.0) == 1.0  # no time between them


def test_a_profile_with_its_engine_steps_scaled():
    p = load_profile(str(CPU_PROFILE))
    p = dataclasses.replace(p, cluster_decodes={"2": dict(p.cluster)})
    scaled = p.engine_scaled(2.0)
    assert scaled.engine == {k: 2.0 * v for k, v in p.engine.items()}
    assert scaled.cluster == p.cluster and scaled.cluster_prefill == p.cluster_prefill
    assert scaled.cluster_decodes == p.cluster_decodes
    assert scaled.tiers == p.tiers and scaled.link == p.link and scaled.handoff == p.handoff
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive finite"):
            p.engine_scaled(bad)
    with pytest.raises(ValueError, match="only a fitted profile"):
        load_profile("h200").engine_scaled(2.0)


def test_a_profile_with_a_clusters_steps_scaled():
    """The decode coefficients a 1PnD cluster is simulated with (`cluster_decode(n)`) and
    the prefill batches scale; nothing else does."""
    one = load_profile(str(CPU_PROFILE)).cluster
    p = _profile(**{n: {k: int(n) * v for k, v in one.items()} for n in ("2", "4")})
    for decodes, key in ((1, None), (2, "2"), (3, "2"), (4, "4")):
        scaled = p.cluster_scaled(decodes, 1.5, 0.5)
        assert scaled.cluster_decode(decodes) == {
            k: 1.5 * v for k, v in p.cluster_decode(decodes).items()
        }
        assert scaled.cluster_prefill == {k: 0.5 * v for k, v in p.cluster_prefill.items()}
        if key is None:  # 1P1D's own; the others as measured
            assert scaled.cluster_decodes == p.cluster_decodes
        else:
            assert scaled.cluster == p.cluster
            others = {n: c for n, c in p.cluster_decodes.items() if n != key}
            assert {n: c for n, c in scaled.cluster_decodes.items() if n != key} == others
        assert scaled.engine == p.engine and scaled.tiers == p.tiers
        assert scaled.link == p.link and scaled.handoff == p.handoff
    for bad in ((0.0, 1.0), (1.0, -1.0), (float("nan"), 1.0), (1.0, float("inf"))):
        with pytest.raises(ValueError, match="positive finite"):
            p.cluster_scaled(1, *bad)
    with pytest.raises(ValueError, match="positive finite"):
        p.cluster_scaled(1, 1.0, 1.0, decode_per_seq=0.0)
    with pytest.raises(ValueError, match="only a fitted profile"):
        load_profile("h200").cluster_scaled(1, 2.0, 2.0)


def test_a_clusters_per_sequence_terms_scale_by_their_own_factor():
    """decode_per_seq multiplies the terms that grow with the batch (seqs, sampled, past
    each knee) and `decode` the rest (intercept, context): a step of n sequences then costs
    decode x base(n) + decode_per_seq x per_seq(n)."""
    from pdserve.sim.cost import FittedCost, StepWork
    from pdserve.sim.profile import per_seq_term

    one = {"intercept": 0.05, "seqs": 1e-3, "sampled": 2e-4, "decode_context": 4e-6}
    p = dataclasses.replace(_profile(), cluster={**one, "seqs_past_8": 5e-4})
    scaled = p.cluster_scaled(1, 0.8, 1.0, decode_per_seq=1.3)
    assert scaled.cluster == pytest.approx(
        {
            "intercept": 0.04,
            "seqs": 1.3e-3,
            "sampled": 2.6e-4,
            "decode_context": 3.2e-6,
            "seqs_past_8": 6.5e-4,
        }
    )
    assert "per seq x1.3" in scaled.name
    for n in (1, 8, 16):
        w = StepWork(n, n, 100 * n, 0, 0.0, n, 0)
        fixed = 0.05 + 4e-6 * 100 * n
        grows = 1e-3 * n + 2e-4 * n + 5e-4 * max(0, n - 8)
        assert FittedCost(scaled.cluster).step_seconds(w) == pytest.approx(
            0.8 * fixed + 1.3 * grows
        )
    assert [per_seq_term(t) for t in ("intercept", "decode_context", "prefill_tokens")] == [
        False,
        False,
        False,
    ]
    assert all(per_seq_term(t) for t in ("seqs", "sampled", "seqs_past_4", "seqs_past_128"))
    # without decode_per_seq every term scales by `decode`, as before
    assert p.cluster_scaled(1, 0.8, 1.0).cluster == pytest.approx(
        {k: 0.8 * v for k, v in p.cluster.items()}
    )


def test_the_split_of_a_probes_steps_into_two_factors():
    """split_over: each batch size's median ratio at its median share of per-sequence time,
    the small batches' and the large ones' averaged, give back the factors the steps were
    made with, whatever a few outlying steps (a prefill turn) measure and however the steps
    fall between batch sizes of a group; None where the groups are too few or absent."""
    from pdserve.sim.cost import FittedCost, StepWork
    from pdserve.sim.fit import MIN_BIN, MIN_GROUP, split_over
    from pdserve.sim.profile import per_seq_term

    coef = load_profile(str(CPU_PROFILE)).cluster
    base = FittedCost({k: v for k, v in coef.items() if not per_seq_term(k)})
    grows = FittedCost({k: v for k, v in coef.items() if per_seq_term(k)})

    def steps(batches, a, b, repeat=11, noise=0.0):
        return [
            (
                w,
                (a * base.step_seconds(w) + b * grows.step_seconds(w))
                * (1 + noise * (0, 1, -1)[i % 3]),
            )
            for n in batches
            for i in range(repeat)
            if (w := StepWork(n, n, 60 * n, 0, 0.0, n, 0))
        ]

    made = steps((1,), 0.8, 1.3) + steps((12,), 0.8, 1.3)
    split = split_over(made, coef)
    assert split["base"] == pytest.approx(0.8) and split["per_seq"] == pytest.approx(1.3)
    assert split["small"]["steps"] == split["large"]["steps"] == 11
    assert split["small"]["batches"] == [1] and split["large"]["batches"] == [12]
    assert split["large"]["measured_over_profile"] > split["small"]["measured_over_profile"]
    # a few steps that ran long (twice the time) at either size move neither factor
    slow = [(w, 2 * t) for w, t in steps((1, 12), 0.8, 1.3, repeat=3)]
    again = split_over(made + slow, coef)
    assert again["base"] == pytest.approx(0.8, rel=0.02)
    assert again["per_seq"] == pytest.approx(1.3, rel=0.05)
    # groups that mix batch sizes, in either proportion, with +-5% on every step: a group's
    # median ratio and median share taken over the group would come from different steps
    # and move per_seq by ~0.16 between the two (found in review); per batch size they
    # do not
    for ones, fours in ((131, 125), (125, 131)):
        mixed = (
            steps((1,), 0.82, 1.4, ones, 0.05)
            + steps((4,), 0.82, 1.4, fours, 0.05)
            + steps((11, 12), 0.82, 1.4, 11, 0.05)
        )
        got = split_over(mixed, coef)
        assert got["small"]["batches"] == [1, 4] and got["large"]["batches"] == [11, 12]
        assert got["base"] == pytest.approx(0.82, rel=0.01)
        assert got["per_seq"] == pytest.approx(1.4, rel=0.02)
    # batches between the groups, and batch sizes with fewer than MIN_BIN steps, are not used
    assert split_over(made + steps((6,), 3.0, 3.0), coef)["base"] == pytest.approx(0.8)
    rare = steps((16,), 3.0, 3.0, repeat=MIN_BIN - 1)
    assert split_over(made + rare, coef)["per_seq"] == pytest.approx(1.3)
    assert split_over(steps((1, 2, 3, 4), 0.8, 1.3), coef) is None  # no large batch
    few = steps((1,), 0.8, 1.3) + steps((12,), 0.8, 1.3, repeat=MIN_GROUP - 1)
    assert split_over(few, coef) is None
    # a per-sequence factor that would have to be negative: no split
    assert split_over(steps((1,), 1.0, 1.0) + steps((12,), 0.2, 0.2), coef) is None


def test_a_cluster_probe_uses_its_prefill_factor_only_after_enough_batches(monkeypatch):
    """The probe's factors: measured over the profile's predicted time, per part; prefill's
    only from MIN_PREFILLS batches on (else 1.0, as given) and never from the batches of
    BATCHES' short prompts; the decode factor split in two when the steps of BATCHES give
    enough large batches (else one); no figures from a pool too small for the probe or a
    probe with no decode step."""
    from pdserve.sim import vs_cluster
    from pdserve.sim.cost import FittedCost, StepWork
    from pdserve.sim.vs_real import Comparison

    p = load_profile(str(CPU_PROFILE))
    decode_cost, prefill_cost = FittedCost(p.cluster), FittedCost(p.cluster_prefill)
    decode = [
        (w, 1.2 * decode_cost.step_seconds(w))
        for n in (1, 2, 4)
        if (w := StepWork(n, n, 100 * n, 0, 0.0, n, 0))
    ]
    prefill = [
        (w, 0.5 * prefill_cost.step_seconds(w))
        for n in (1, 2, 3)
        if (w := StepWork(n, 32 * n, 0, 32 * n, 528.0 * n, n, 32 * n, prefill_seqs=n))
    ]
    short_prompts = [(w, 10 * t) for w, t in prefill]  # BATCHES' prefills: never used
    served = []

    def serve(address, vocab, loads, decodes, seed):
        served.append((address, vocab, loads, decodes, seed))
        return [loads]  # the "traces" _steps is handed below

    def steps_of(probe, batches):
        return lambda traces: probe if traces == [vs_cluster.PROBE] else batches

    monkeypatch.setattr(vs_cluster, "serve_loads", serve)
    cmp = Comparison("tiny-llama", p, ("greedy+recompute",), (2,), 32, 4, 8, 16, 0, "")
    enough, few = prefill[: vs_cluster.MIN_PREFILLS], prefill[: vs_cluster.MIN_PREFILLS - 1]
    for seen, factor in (([], 1.0), (few, 1.0), (enough, 0.5)):
        monkeypatch.setattr(vs_cluster, "_steps", steps_of((decode, seen), ([], short_prompts)))
        drift = vs_cluster.cluster_drift("address", cmp, p)
        assert drift["decode"]["steps"] == 3 and drift["split"] is None  # no large batch
        assert drift["factors"] == pytest.approx({"decode": 1.2, "prefill": factor})
        if seen:
            assert drift["prefill"]["measured_over_profile"] == pytest.approx(0.5)
            assert drift["prefill"]["used"] == (seen is enough)
        scaled = p.cluster_scaled(1, **drift["factors"])
        assert scaled.cluster_prefill == pytest.approx(
            {k: factor * v for k, v in p.cluster_prefill.items()}
        )
    assert [s[2] for s in served] == [vs_cluster.PROBE, vs_cluster.BATCHES] * 3
    # BATCHES' steps of 12 sequences at 1.2x the intercept and 1.5x per sequence: the split
    grows = FittedCost({k: v for k, v in p.cluster.items() if per_seq_term(k)})
    small, large = (
        [
            (w, 1.2 * decode_cost.step_seconds(w) + 0.3 * grows.step_seconds(w))
            for n in batches
            if (w := StepWork(n, n, 10 * n, 0, 0.0, n, 0))
        ]
        for batches in ((1, 2, 4) * fit.MIN_BIN, (12,) * fit.MIN_GROUP)
    )
    monkeypatch.setattr(vs_cluster, "_steps", steps_of((small, enough), (large, [])))
    drift = vs_cluster.cluster_drift("address", cmp, p)
    assert drift["split"]["large"]["steps"] == fit.MIN_GROUP
    assert drift["factors"] == pytest.approx({"decode": 1.2, "decode_per_seq": 1.5, "prefill": 0.5})
    # the median still over every step
    assert drift["decode"]["steps"] == 3 * fit.MIN_BIN + fit.MIN_GROUP
    # a 1P2D cluster is measured against 1P2D's coefficients (twice 1P1D's here), and a
    # profile without cluster_prefill against the engine's, as the simulator costs them
    two = dataclasses.replace(
        p, cluster_decodes={"2": {k: 2 * v for k, v in p.cluster.items()}}, cluster_prefill={}
    )
    engine_cost = FittedCost(p.engine)
    by_engine = [(w, 0.5 * engine_cost.step_seconds(w)) for w, _ in prefill]
    monkeypatch.setattr(vs_cluster, "_steps", steps_of((decode, by_engine), ([], [])))
    drift = vs_cluster.cluster_drift("address", dataclasses.replace(cmp, decode_workers=2), two)
    assert drift["factors"] == pytest.approx({"decode": 0.6, "prefill": 0.5})
    assert two.cluster_scaled(2, 0.6, 0.5).cluster_prefill == pytest.approx(
        {k: 0.5 * v for k, v in p.engine.items()}
    )
    assert served[-1][3] == served[-2][3] == 2  # clients doubled for two decode workers
    monkeypatch.setattr(vs_cluster, "_steps", lambda traces: ([], prefill))
    assert "no decode step" in vs_cluster.cluster_drift("address", cmp, p)["skipped"]
    small = dataclasses.replace(cmp, num_kv_blocks=vs_cluster.PROBE_BLOCKS - 1)
    assert "the probe needs" in vs_cluster.cluster_drift("address", small, p)["skipped"]
    assert len(served) == 12  # the small pool was not probed
    vs_cluster.check_cluster_probe(small)  # without --rescale the points run unprobed
    with pytest.raises(ValueError, match=f"needs {vs_cluster.PROBE_BLOCKS} blocks"):
        vs_cluster.check_cluster_probe(dataclasses.replace(small, rescale=True))


def test_the_table_says_how_far_each_cluster_drifted():
    from pdserve.sim.vs_real import format_table

    def probe(policy, decode, prefill, used=True):
        seen = {"measured_over_profile": prefill, "steps": 9, "used": used}
        return {
            "policy": policy,
            "decode": {"measured_over_profile": decode, "steps": 64, "used": True},
            "prefill": None if prefill is None else seen,
            "factors": {"decode": decode, "prefill": prefill if used and prefill else 1.0},
        }

    report = {
        **EMPTY_REPORT,
        "cluster_drift": [
            probe("a", 1.04, 0.95),
            probe("b", 1.02, 1.4),
            probe("c", 0.8, None),
            probe("d", 1.0, 2.0, used=False),
            {"policy": "e", "skipped": "pool of 8 blocks < 24 the probe needs"},
            {
                **probe("f", 0.98, 1.0),
                "split": {
                    "base": 0.97,
                    "per_seq": 1.6,  # far off, but not what says stale
                    "small": {"measured_over_profile": 0.98, "batches": [1, 4], "steps": 260},
                    "large": {"measured_over_profile": 1.04, "batches": [12], "steps": 30},
                },
                "preemptions": 2,
            },
            {
                **probe("g", 1.0, 1.0),
                "split": {
                    "base": 1.0,
                    "per_seq": 1.0,
                    "small": {"measured_over_profile": 1.0, "batches": [1], "steps": 100},
                    "large": {"measured_over_profile": 1.3, "batches": [12], "steps": 30},
                },
            },
        ],
    }
    lines = format_table(report).splitlines()

    def line(policy):
        [found] = [x for x in lines if f"the {policy} cluster's probe" in x]
        return found

    assert "decode 1.04x (64), prefill 0.95x (9)" in line("a") and "stale" not in line("a")
    assert "prefill 1.40x" in line("b") and "the profile is stale" in line("b")  # one part
    assert "decode 0.80x (64)" in line("c") and "stale" in line("c")
    assert "prefill 2.00x (9, too few: not used)" in line("d") and "stale" not in line("d")
    assert "skipped (pool of 8 blocks" in line("e")
    f = line("f")
    assert "batches <= 4 0.98x (260), >= 8 1.04x (30)" in f
    assert "split 0.97x whatever the batch, 1.60x per sequence" in f
    assert "2 preemptions while it ran" in f and "stale" not in f
    assert "stale" in line("g")  # its large batches ran 1.3x the profile's time
    assert "preemptions" not in line("a")


def test_a_cluster_only_comparison_checks_its_profile_before_any_probe(monkeypatch):
    """--no-engine runs no engine probe (on a GPU it would hold the device while the
    cluster's workers start), and a profile that cannot be compared, or rescaled, is refused
    before anything runs."""
    from pdserve.sim import vs_real

    def no_probe(cmp):
        raise AssertionError("the engine was probed")

    monkeypatch.setattr(vs_real, "engine_drift", no_probe)
    profile = load_profile(str(CPU_PROFILE))  # no cluster_decodes
    with pytest.raises(ValueError, match="no decode steps measured with 2"):
        vs_real.bench_sim_vs_real(
            "tiny-llama", profile, cluster=True, decode_workers=2, engine=False
        )
    roofline = load_profile("h200")
    for engine in (True, False):
        with pytest.raises(ValueError, match="rescale: profile h200 is no fitted one"):
            vs_real.bench_sim_vs_real(
                "tiny-llama", roofline, cluster=True, engine=engine, rescale=True
            )


def test_a_decode_workers_recompute_chunk_costs_the_engines_prefill_terms():
    """A simulated decode worker's step with a recompute chunk in it costs the decode step's
    terms plus what the in-process engine's fit says a prefill adds (the same core and
    runner); a pure decode step costs the cluster's fit alone, as before."""
    from pdserve.sim.cost import FittedCost, StepWork

    p = load_profile(str(CPU_PROFILE))
    setup = Setup(model_config("tiny-llama"), p, Topology(prefill=1, decode=1), EngineArgs())
    cost, decode = setup.cost("decode"), FittedCost(p.cluster)
    pure = StepWork(4, 4, 400, 0, 0.0, 4, 404)
    assert cost.step_seconds(pure) == pytest.approx(decode.step_seconds(pure))
    # four decoding sequences and one 96-token context recomputed
    mixed = StepWork(5, 100, 400, 96, 96 * 48.5, 5, 500, prefill_seqs=1)
    engine = p.engine
    # at the decode worker's speed: its intercept over the engine's
    slower = p.cluster["intercept"] / engine["intercept"]
    added = slower * (
        engine.get("prefill_tokens", 0.0) * 96
        + engine.get("prefill_attention", 0.0) * 96 * 48.5
        + engine.get("prefill_seqs", 0.0)
        + engine.get("prefill_step", 0.0)
    )
    assert added > 0.02  # tens of milliseconds on this machine's profile, not nothing
    assert cost.step_seconds(mixed) == pytest.approx(decode.step_seconds(mixed) + added)
    # without cluster costs a decode worker's steps are the engine's, whole
    bare = dataclasses.replace(p, cluster={}, cluster_decodes={})
    engine_only = Setup(
        model_config("tiny-llama"), bare, Topology(prefill=1, decode=1), EngineArgs()
    )
    assert engine_only.cost("decode").step_seconds(mixed) == pytest.approx(
        FittedCost(p.engine).step_seconds(mixed)
    )
