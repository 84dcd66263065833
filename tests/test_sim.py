"""The simulator is the real scheduler: same decisions as the real engine on the same load,
the same response to a policy change; its command line; its refusals of bad input."""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys

import pytest

from pdserve.bench.workload import RequestSpec, load_jsonl, prompts_for, specs_of
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.engine.gate import make_admission
from pdserve.sim.cost import FittedCost
from pdserve.sim.engine import sim_engine
from pdserve.sim.load import SLO
from pdserve.sim.profile import load_profile, profile_from_dict
from pdserve.sim.replica import Replica, run_real, run_sim
from pdserve.sim.run import Setup, Topology, simulate
from pdserve.weights import model_config

COST = FittedCost({"intercept": 0.01, "seqs": 0.001, "prefill_tokens": 1e-4})


def decisions(log):
    return [
        (o.ran, o.preempted, o.parked, o.unparked, tuple(d.request_id for d in o.finished))
        for o in log
    ]


def real_and_sim(tmp_path, policy: str, preemption: str, clients: int, **engine):
    """The real tiny-llama engine and the simulator's, same load -> (real log, sim log,
    real stats, sim stats)."""
    args = EngineArgs(
        block_size=4,
        num_kv_blocks=40,
        preemption=preemption,
        spill_dir=str(tmp_path),
        **engine,
    )
    specs = specs_of("reasoning", 20, seed=3, mean_output=40, max_output=70)
    core, _ = build_engine("tiny-llama", args)
    prompts = prompts_for(specs, core.model_config.vocab_size, 3)
    real_log, sim_log = [], []
    run_real(Replica("real", core, make_admission(policy, core)), specs, prompts, clients, real_log)
    eng = sim_engine(core.model_config, args, COST, load_profile("h200"), 40, kv_dtype="float32")
    replica = Replica("sim", eng.core, make_admission(policy, eng.core))
    run_sim([(replica, eng)], specs, prompts, clients, step_log=sim_log)
    core.check_integrity()
    eng.core.check_integrity()
    stats = core.stats(), eng.core.stats()
    core.close()
    return real_log, sim_log, *stats


@pytest.mark.parametrize(
    "policy,preemption",
    [("greedy", "recompute"), ("greedy", "tiered"), ("kv-aware", "tiered"), ("kv-aware", "swap")],
)
def test_the_simulated_decisions_are_the_real_ones(tmp_path, policy, preemption):
    real_log, sim_log, real, sim = real_and_sim(tmp_path, policy, preemption, clients=6)
    assert decisions(real_log) == decisions(sim_log)
    assert real.preemptions == sim.preemptions
    assert real.recomputed_tokens == sim.recomputed_tokens
    assert real.spilled_bytes == sim.spilled_bytes  # same blocks, same bytes per block
    if policy == "greedy":
        assert real.preemptions > 0, "the load must preempt for this test to mean anything"


def test_a_policy_change_changes_both_the_same_way(tmp_path):
    wide = real_and_sim(tmp_path, "greedy", "recompute", clients=6)
    narrow = real_and_sim(tmp_path, "greedy", "recompute", clients=6, max_num_seqs=2)
    assert decisions(wide[0]) != decisions(narrow[0])  # the change did something
    assert decisions(narrow[0]) == decisions(narrow[1])
    assert wide[2].preemptions > narrow[2].preemptions == narrow[3].preemptions


def test_dp_replicas_route_by_headroom_and_leak_nothing():
    config = model_config("tiny-llama")
    specs = specs_of("reasoning", 48, seed=1, mean_output=60, max_output=100)
    args = EngineArgs(block_size=4, num_kv_blocks=60, preemption="swap")
    points = {}
    for route in ("headroom", "round-robin"):
        setup = Setup(config, load_profile("h200"), Topology(dp=3, route=route), args)
        points[route] = simulate(setup, "greedy+swap", specs, concurrency=16)
    for p in points.values():
        assert p["errors"] == 0 and p["generated_tokens"] == sum(s.output_tokens for s in specs)
        assert set(p["per_worker"]) == {"replica-0", "replica-1", "replica-2"}
        assert all(w["requests"] > 0 for w in p["per_worker"].values())


def test_a_simulated_run_keeps_the_garbage_collector_out_of_its_steps(monkeypatch):
    """A full collection walks every token id alive; a simulated run pauses the collector
    for its steps (pdserve/sim/run.py collector_paused) and turns it on again after."""
    import pdserve.sim.run as sim_run

    config = model_config("tiny-llama")
    specs = specs_of("reasoning", 40, seed=1, mean_output=60, max_output=100)
    args = EngineArgs(block_size=4, num_kv_blocks=60)
    collections, seen = [], {}

    def counted(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    def watched(*a, **kw):
        seen["enabled"], before = gc.isenabled(), len(collections)
        out = run_sim(*a, **kw)
        seen["collected"] = len(collections) - before
        return out

    # a low threshold, so that the unpaused run collects whatever count gc starts from
    # (at the default 700 it once started close enough to zero to finish without one)
    threshold = gc.get_threshold()
    gc.set_threshold(50)
    gc.callbacks.append(counted)
    try:
        eng = sim_engine(config, args, COST, load_profile("h200"), 60)
        run_sim(
            [(Replica("bare", eng.core), eng)], specs, prompts_for(specs, config.vocab_size, 1), 16
        )
        unpaused = len(collections)
        monkeypatch.setattr(sim_run, "run_sim", watched)
        setup = Setup(config, load_profile("h200"), Topology(dp=2), args)
        point = simulate(setup, "greedy+recompute", specs, concurrency=16)
    finally:
        gc.callbacks.remove(counted)
        gc.set_threshold(*threshold)
    assert unpaused > 0, "the load must be big enough to collect without the pause"
    assert seen == {"enabled": False, "collected": 0}
    assert gc.isenabled()
    assert point["generated_tokens"] == sum(s.output_tokens for s in specs)


def test_a_disaggregated_cluster_serves_every_request():
    config = model_config("tiny-deepseek")
    specs = specs_of("reasoning", 30, seed=2, mean_output=40, max_output=80)
    args = EngineArgs(block_size=4, num_kv_blocks=80)
    setup = Setup(config, load_profile("h200"), Topology(prefill=1, decode=2), args)
    for policy in ("greedy+recompute", "kv-aware+tiered"):
        p = simulate(setup, policy, specs, concurrency=12)
        assert p["errors"] == 0
        assert p["generated_tokens"] == sum(s.output_tokens for s in specs)
        assert p["ttft_p50_s"] > 0 and p["tpot_p50_s"] > 0
        assert set(p["per_worker"]) == {"decode-0", "decode-1"}
        if policy.startswith("kv-aware"):
            assert p["recomputed_tokens"] == 0


def test_simulated_migration_moves_requests_to_a_late_replica_and_leaks_nothing():
    """Skewed arrivals on a simulated 1P2D cluster (decode-1 joins after half the requests
    arrived; Qwen2.5-32B on the H200 profile, 300 blocks per worker): with `+migrate` the
    router's real rebalancer moves requests to it, every request still gets all its tokens,
    nothing leaks (simulate checks every engine's books), and fewer are preempted and
    recomputed than without."""
    import dataclasses

    config = model_config("pdserve/sim/configs/qwen2.5-32b.json")
    specs = specs_of("reasoning", 60, seed=2, mean_output=400, max_output=1200)
    args = EngineArgs(block_size=16, num_kv_blocks=300)
    setup = Setup(config, load_profile("h200"), Topology(prefill=1, decode=2), args)
    setup = dataclasses.replace(setup, skew="late-join")
    policies = ("greedy+recompute", "greedy+recompute+migrate")
    still, moved = (simulate(setup, p, specs, concurrency=10, label="") for p in policies)
    for p in (still, moved):
        assert p["errors"] == 0
        assert p["generated_tokens"] == sum(s.output_tokens for s in specs)
    assert still["migrations"] == 0 and moved["migrations"] > 0
    assert moved["preemptions"] < still["preemptions"]
    assert moved["recomputed_tokens"] < still["recomputed_tokens"]
    colocated = Setup(config, load_profile("h200"), Topology(dp=2), args)
    with pytest.raises(ValueError, match="decode workers"):
        simulate(colocated, "greedy+swap+migrate", specs, 4)


def test_scale_out_sends_the_first_wave_to_one_worker_and_the_rest_anywhere():
    """skew="scale-out": decode-1 takes nothing until every request of the first wave (one
    per client) started on decode-0 (a draining worker takes work only when no other can:
    the wave's prompts fit on decode-0, and its growth does not: it preempts there)."""
    import dataclasses

    config = model_config("tiny-deepseek")
    specs = specs_of("reasoning", 24, seed=2, mean_output=40, max_output=80)
    args = EngineArgs(block_size=4, num_kv_blocks=100)
    setup = Setup(config, load_profile("h200"), Topology(prefill=1, decode=2), args)
    setup = dataclasses.replace(setup, skew="scale-out")
    wave = simulate(setup, "greedy+recompute", specs[:12], concurrency=12, label="")
    assert wave["per_worker"]["decode-1"]["requests"] == 0 and wave["preemptions"] > 0
    assert wave["generated_tokens"] == sum(s.output_tokens for s in specs[:12])
    two = simulate(setup, "greedy+recompute", specs, concurrency=12, label="")
    assert two["per_worker"]["decode-1"]["requests"] > 0  # the second wave may go there
    assert two["generated_tokens"] == sum(s.output_tokens for s in specs)


def test_h200_kv_capacity_is_the_arithmetic():
    from pdserve.sim.engine import kv_blocks
    from pdserve.sim.shape import ModelShape

    config = model_config("pdserve/sim/configs/qwen2.5-32b.json")
    h200 = load_profile("h200")
    for tp, heads in ((1, 8), (8, 1)):
        shape = ModelShape.of(config, 2, 2, tp)
        per_token = 2 * 64 * heads * 128 * 2  # K and V, 64 layers, this GPU's heads, bf16
        assert shape.kv_bytes_per_token == per_token
        free = h200.memory_bytes * 0.9 - 4e9 - shape.weight_bytes
        assert kv_blocks(h200, shape, 16) == int(free // (per_token * 16))


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "sim", *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_command_line_writes_every_policy_figure(tmp_path):
    workload = tmp_path / "w.jsonl"
    rows = [
        {"arrival_s": 0.01 * i, "prompt_tokens": 20 + i, "output_tokens": 30} for i in range(12)
    ]
    workload.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "sim.json"
    proc = run_cli(
        "--model", "tiny-llama", "--num-kv-blocks", "30", "--block-size", "4",
        "--policy", "greedy+recompute,kv-aware+tiered", "--no-prefix-caching",
        "--workload", str(workload), "--concurrency", "4", "--json", str(out),
        "--plot", str(tmp_path / "plots"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["simulated"] is True and report["profile"]["name"] == "h200"
    assert [p["policy"] for p in report["points"]] == ["greedy+recompute", "kv-aware+tiered"]
    for p in report["points"]:
        for key in (
            "throughput_tok_s",
            "preemptions",
            "recomputed_tokens",
            "generated_tokens",
            "ttft_p50_s",
            "ttft_p99_s",
            "tpot_p50_s",
            "tpot_p99_s",
            "goodput_req_s",
        ):
            assert key in p, key
        assert p["generated_tokens"] == 12 * 30
    assert (tmp_path / "plots" / "kv_usage.png").is_file()
    assert "SIMULATED" in proc.stdout


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "tiny-llama", "--profile", "a100"],
         "profile: unknown 'a100'; built in: h100, h200"),
        (["--model", "tiny-llama", "--concurrency", "2", "--workload", "chat"],
         "workload: unknown 'chat'"),
        (["--model", "tiny-llama", "--concurrency", "2", "--policy", "lucky+recompute"], "policy:"),
        (["--model", "pdserve/sim/configs/qwen2.5-32b.json", "--profile", "h100",
          "--concurrency", "2", "--weight-dtype", "bf16", "--tp", "1", "--max-model-len", "99999"],
         "max_model_len: 99999 exceeds"),
    ],
)  # fmt: skip
def test_bad_input_is_one_clear_line(argv, message):
    proc = run_cli(*argv)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_workload_rows_name_their_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = '{"prompt_tokens": 5, "output_tokens": 3}'
    bad = '{"prompt_tokens": 0, "output_tokens": 3}'
    path.write_text(f"{good}\n\n{bad}\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: prompt_tokens: a positive integer"):
        load_jsonl(str(path))
    path.write_text('{"prompt_tokens": 5, "output_tokens": 3, "arrival_s": "soon"}\n')
    with pytest.raises(ValueError, match=r":1: arrival_s: a finite number"):
        load_jsonl(str(path))
    path.write_text("not json\n")
    with pytest.raises(ValueError, match=r":1: not valid JSON"):
        load_jsonl(str(path))
    assert load_jsonl_ok(tmp_path) == [RequestSpec(0.5, 4, 2)]


def load_jsonl_ok(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text('{"arrival_s": 0.5, "prompt_tokens": 4, "output_tokens": 2}\n')
    return load_jsonl(str(path))


def test_profiles_and_configs_refuse_what_they_cannot_use(tmp_path):
    with pytest.raises(ValueError, match="kind: 'magic'"):
        profile_from_dict(
            {"name": "x", "kind": "magic", "memory_bytes": 1, "usable_fraction": 1,
             "activation_reserve_bytes": 0, "tiers": {}, "link": {"bytes_s": 1}}
        )  # fmt: skip
    with pytest.raises(ValueError, match="unknown field 'hbm'"):
        profile_from_dict({"name": "x", "hbm": 1})
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    with pytest.raises(ValueError, match="config.json: missing field 'num_attention_heads'"):
        model_config(str(config))
    with pytest.raises(ValueError, match="weights .* leave no room for KV"):
        Setup(
            model_config("pdserve/sim/configs/deepseek-v3.json"),
            load_profile("h200"),
            Topology(tp=1),
            EngineArgs(),
        ).num_blocks()


def test_plan_ranks_by_goodput_and_confirms_its_winner():
    from pdserve.sim.plan import Candidate, evaluate, layouts, plan, score

    config = model_config("tiny-llama")
    h200 = load_profile("h200")
    assert {t.describe() for t in layouts(config, h200, 2, 2)} == {
        "DP=2, TP=1",
        "1P1D, TP=1",
        "DP=1, TP=2",
    }
    specs = specs_of("reasoning", 16, seed=4, mean_output=30, max_output=60)
    args = EngineArgs(block_size=4, num_kv_blocks=40)
    report = plan(config, h200, 2, specs, 6, SLO(2.0, 0.05), args, sample=8)
    goodputs = [r["goodput_req_s"] for r in report["ranked"]]
    assert goodputs == sorted(goodputs, reverse=True) and len(goodputs) == report["candidates"]
    best = report["best"]
    assert best["layout"] == report["ranked"][0]["layout"]
    # the printed figure is a fresh simulation of the winner on every request
    winner = Candidate(
        Topology(**best["topology"]), best["policy"], best["max_num_seqs"], best["host_tier_x"]
    )
    base = Setup(config, h200, Topology(), args, 2, SLO(2.0, 0.05))
    again = evaluate(base, winner, specs, 6)
    assert score(again) == (best["goodput_req_s"], best["throughput_tok_s"])
    assert report["requests"] == {"searched": 8, "confirmed": 16}


def test_plan_refuses_what_it_cannot_place():
    from pdserve.sim.plan import layouts, tp_refusals

    # tiny-llama's 4 heads split 1, 2 or 4 ways, not 8: TP=8 is skipped, with its reason
    h200, tiny = load_profile("h200"), model_config("tiny-llama")
    assert {t.tp for t in layouts(tiny, h200, 8, 2)} == {1, 2, 4}
    refusals = tp_refusals(tiny, h200, 8, 2)
    assert list(refusals) == [1, 2, 4, 8] and refusals[4] is None
    assert "8 does not divide the model's 4 heads" in refusals[8]
    with pytest.raises(ValueError, match="gpus: must be >= 1"):
        layouts(model_config("tiny-llama"), load_profile("h200"), 0, 2)
    with pytest.raises(ValueError, match="does not fit 1 x h200"):
        layouts(model_config("pdserve/sim/configs/deepseek-v3.json"), load_profile("h200"), 1, 1)


def test_sim_vs_real_names_every_figure_outside_its_bound():
    from pdserve.sim.vs_real import compare

    real = dict(throughput_tok_s=100.0, ttft_p50_s=1.0, tpot_p50_s=0.1, ttft_p99_s=2.0)
    real.update(tpot_p99_s=0.2, preemptions=10, recomputed_tokens=100, spilled_bytes=0)
    sim = dict(real, throughput_tok_s=114.0, ttft_p99_s=2.7, tpot_p50_s=0.12, preemptions=13)
    got = compare(sim, real, counts=True)
    assert [m.split(":")[0] for m in got["misses"]] == ["tpot_p50_s", "ttft_p99_s", "preemptions"]
    assert got["ratio"]["throughput_tok_s"] == pytest.approx(1.14)
    assert got["ratio"]["spilled_bytes"] == 1.0  # both zero
    assert [m.split(":")[0] for m in compare(sim, real, counts=False)["misses"]] == [
        "tpot_p50_s",
        "ttft_p99_s",
    ]


def test_sim_vs_real_says_why_a_miss_is_the_real_runs_disagreement_or_the_models():
    """--repeat: the first real run is the comparison; a miss is the real runs' disagreement
    only when no single figure is within the bound of every run and the simulated one is
    within it of as many runs as any figure could be; otherwise the model's error."""
    from pdserve.sim.vs_real import TIMING, best_coverage, compare, with_spread

    assert best_coverage([1.0, 1.3], 0.15) == (pytest.approx(1.105), 1.0)  # 1.3 * 0.85
    assert best_coverage([1.0, 1.36], 0.15)[1] == 0.5  # 1.36 * 0.85 > 1.15
    assert best_coverage([0.0, 0.0], 0.2) == (0.0, 1.0)
    assert best_coverage([0.0, 2.0], 0.2)[1] == 0.5  # only 0 predicts 0
    base = dict(throughput_tok_s=100.0, ttft_p50_s=1.0, tpot_p50_s=0.1, ttft_p99_s=4.0)
    base.update(tpot_p99_s=0.2, preemptions=10, recomputed_tokens=100, spilled_bytes=0)
    reals = [
        base,
        dict(base, tpot_p99_s=0.5, preemptions=4, throughput_tok_s=130.0, ttft_p99_s=2.0),
        # a run whose TPOT is a percentile of nothing: left out of that figure's range
        dict(base, tpot_p99_s=0.35, tpot_p50_s=math.nan, ttft_p99_s=2.2),
    ]
    # TPOT p99 0.4 (runs 0.2 / 0.5 / 0.35, 30%): no figure is within it of all three, 0.4 is
    # of two (0.5, 0.35), as many as any: the runs' disagreement. TTFT p99 1.8 (runs 4.0 /
    # 2.0 / 2.2): below them all, yet within 30% of two, as many as any: the same.
    # Throughput 120 (runs 100 / 130 / 100): 110.5 is within 15% of all three, 120 of one:
    # the model's error. Preemptions 20 (runs 10 / 4 / 10): 8 is within 20% of two, 20 of
    # none. TTFT p50 0.8 (runs all 1.0): 0.85 fits them all.
    sim = dict(base, tpot_p99_s=0.4, preemptions=20, ttft_p50_s=0.8, throughput_tok_s=120.0)
    sim.update(ttft_p99_s=1.8)
    got = with_spread(compare(sim, base, counts=True), sim, reals)
    figures = [m.split(":")[0] for m in got["misses"]]
    assert figures == ["throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "preemptions"]
    assert got["misses_from_real_spread"] == 2
    s = got["spread"]
    assert set(s) == set(TIMING) | {"preemptions", "recomputed_tokens", "spilled_bytes"}
    assert s["tpot_p99_s"] == {
        "min": 0.2, "max": 0.5, "runs": 3, "within": 2, "best": pytest.approx(0.245),
        "best_within": 2, "real_spread": True,
    }  # fmt: skip
    assert s["ttft_p99_s"]["real_spread"] and s["ttft_p99_s"]["within"] == 2
    assert (s["throughput_tok_s"]["best_within"], s["throughput_tok_s"]["within"]) == (3, 1)
    assert (s["preemptions"]["best_within"], s["preemptions"]["within"]) == (2, 0)
    assert not any(s[f]["real_spread"] for f in ("throughput_tok_s", "preemptions"))
    assert s["tpot_p50_s"]["runs"] == 2 and s["tpot_p50_s"]["min"] == 0.1  # NaN left out
    assert s["spilled_bytes"]["within"] == 3  # 0 predicts 0
    throughput, ttft, ttft99, tpot, preempt = got["misses"]
    assert "the real runs' disagreement: no figure is within the bound of all 3" in tpot
    assert "this one is within it of 2, as many as any could be" in tpot
    assert "(runs 0.2-0.5, 2.50x apart)" in tpot
    assert "the real runs' disagreement" in ttft99
    assert "the model's error: 110.5 would be within the bound of 3 of the 3 runs" in throughput
    assert "this one is within it of 1" in throughput
    assert "the model's error: 8 would be within the bound of 2 of the 3 runs" in preempt
    assert "the model's error" in ttft and "1.00x apart" in ttft
    # one run: compare's result as it was, nothing added
    one = compare(sim, base, counts=True)
    assert with_spread(one, sim, [base]) == one


def test_sim_vs_real_repeats_each_real_point_and_reports_its_spread(monkeypatch):
    """A real engine half with repeat=2 and --rescale: each load and round ran with prompts
    of its own tokens, the first round is the comparison, both runs' spread is in the point
    (and in its unscaled half), and the table counts the misses that are the runs'
    disagreement."""
    from pdserve.sim import vs_real
    from pdserve.sim.vs_real import bench_sim_vs_real, format_table

    seeds, real_prompts_for = [], vs_real.prompts_for

    def prompts_for(specs, vocab, seed):
        seeds.append((len(specs), seed))
        return real_prompts_for(specs, vocab, seed)

    monkeypatch.setattr(vs_real, "prompts_for", prompts_for)
    profile = load_profile("docs/results/cpu-profile-smollm2-2026-12-07.json")
    with pytest.raises(ValueError, match="repeat: at least 1, got 0"):
        bench_sim_vs_real("tiny-llama", profile, repeat=0)
    report = bench_sim_vs_real(
        "tiny-llama",
        profile,
        concurrencies=(1, 5, 1),  # a load named twice is one point
        policies=("greedy+recompute",),
        num_kv_blocks=16,
        requests=4,
        mean_output=12,
        repeat=2,
        rescale=True,
    )
    assert report["repeat"] == 2
    assert [p["concurrency"] for p in report["points"]] == [1, 5]
    # the warm-up's prompts, then rounds of the loads in turn, every one its own seed
    timed = seeds[1:]
    assert [n for n, _ in timed] == [4, 5, 4, 5]
    assert len({seed for _, seed in timed}) == 4
    for p in report["points"]:
        [again] = p["repeats"]
        assert p["real"]["at_s"] < again["at_s"]  # the comparison is the first round
        assert again["requests"] == p["real"]["requests"] == max(4, p["concurrency"])
        assert again["generated_tokens"] == p["real"]["generated_tokens"]  # same lengths
        for half in (p, p["unscaled"]):
            for figure, s in half["spread"].items():
                values = (p["real"].get(figure, 0.0), again.get(figure, 0.0))
                assert (s["min"], s["max"]) == (min(values), max(values)) and s["runs"] == 2
            for m in half["misses"]:
                assert "the real runs' disagreement" in m or "the model's error" in m
    noise = sum(p["misses_from_real_spread"] for p in report["points"])
    assert report["misses_from_real_spread"] == noise
    assert report["misses_unscaled_from_real_spread"] == sum(
        p["unscaled"]["misses_from_real_spread"] for p in report["points"]
    )
    assert f"{noise} of the {report['misses']} figures outside" in format_table(report)
