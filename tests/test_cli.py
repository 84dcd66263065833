"""The pdserve command line, run as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_the_completion():
    proc = run_cli(
        "generate",
        "--model",
        "smollm2-135m",
        "--chat",
        "--max-tokens",
        "16",
        "--prompt",
        "What is the capital of France?",
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_bad_model_is_one_clear_line_without_traceback():
    proc = run_cli("generate", "--model", "nope", "--prompt", "hi")
    assert proc.returncode == 2
    assert proc.stderr.startswith("pdserve: error: model: 'nope' is neither a preset")
    assert "Traceback" not in proc.stderr


def test_bad_sampling_value_is_reported(capsys):
    assert main(["generate", "--model", "tiny-llama", "--prompt", "x", "--top-p", "2"]) == 2
    assert "top_p: must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_offline_writes_json_with_both_figures(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli(
        "bench",
        "offline",
        "--model",
        "tiny-llama",
        "--batch-sizes",
        "1,4",
        "--requests-at-batch-1",
        "2",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "pdserve tok/s" in proc.stdout and "transformers tok/s" in proc.stdout
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [r["batch_size"] for r in rows] == [1, 4]
    for r in rows:
        assert r["pdserve_tok_s"] > 0 and r["transformers_tok_s"] > 0
        assert r["ratio"] == pytest.approx(r["pdserve_tok_s"] / r["transformers_tok_s"])
    # same weights, same greedy sampling: identical tokens at batch 1
    assert rows[0]["identical_outputs"] == rows[0]["requests"]


def test_bench_transfer_verifies_bytes_and_reports_every_layout(tmp_path):
    out = tmp_path / "transfer.json"
    proc = run_cli("bench", "transfer", "--model", "tiny-llama", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [r["blocks"] for r in report["handoff"]] == [1, 4, 16, 64]
    for r in report["handoff"]:
        for layout in ("contiguous", "allocator", "scattered"):
            assert r[f"{layout}_verified"] and r[f"{layout}_gb_s"] > 0, layout
        assert r["raw_gb_s"] > 0
        assert all(1 <= runs <= r["blocks"] for runs in r["allocator_runs"])
    assert [r["prompt_tokens"] for r in report["ttft"]] == [64, 256]
    assert all(r["layerwise_s"] > 0 and r["after_prefill_s"] > 0 for r in report["ttft"])


# the CPU flags every launching benchmark takes: the default (turns, the router idle, for
# CPU workers) with one load, both turned off with the other
@pytest.mark.parametrize(
    "load", [["--concurrency", "3"], ["--rate", "20", "--no-share-cpus", "--no-router-idle"]]
)
def test_bench_serve_reports_percentiles_without_errors(tmp_path, load):
    out, traces, png = tmp_path / "serve.json", tmp_path / "t.jsonl", tmp_path / "t.png"
    proc = run_cli(
        "bench",
        "serve",
        "--model",
        "tiny-llama",
        "--requests",
        "10",
        "--num-kv-blocks",
        "256",
        *load,
        "--json",
        str(out),
        "--trace",
        str(traces),
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    # one trace per request; its stages cover the request (router clock) within 5%
    lines = traces.read_text().splitlines()
    assert len(lines) == 10
    assert report["trace_coverage"]["p0"] >= 0.95 and report["trace_coverage"]["p100"] <= 1.0
    plotted = run_cli("trace", str(traces), "--plot", str(png))
    assert plotted.returncode == 0, plotted.stderr
    assert "prefill.compute" in plotted.stdout and "spans cover" in plotted.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import torch

    # (with CUDA, tiny-llama's workers compute on it: then neither is on by default; the
    # router idles when the decode worker computes on several threads: every CPU, in turns)
    defaults = "--no-router-idle" not in load and not torch.cuda.is_available()
    assert report["cluster"]["share_cpus"] is defaults
    assert report["cluster"]["router_idle"] is (defaults and os.cpu_count() > 1)
    summary = report["summary"]
    assert summary["requests"] == 10 and summary["errors"] == 0
    assert summary["output_tokens"] == sum(s["output_tokens"] for s in report["samples"]) > 0
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert 0 < summary[key]["p50"] <= summary[key]["p90"] <= summary[key]["p99"]
    assert all(s["server"]["ttft_s"] <= s["server"]["e2e_s"] for s in report["samples"])


def test_bench_serve_replays_a_trace_at_its_arrival_times(tmp_path):
    out = tmp_path / "replay.json"
    proc = run_cli(
        "bench",
        "serve",
        "--model",
        "tiny-llama",
        "--requests",
        "6",
        "--num-kv-blocks",
        "256",
        "--workload",
        "mooncake-conv",
        "--replay",
        "--time-scale",
        "10",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["load"]["replay_time_scale"] == 10
    assert report["summary"]["requests"] == 6 and report["summary"]["errors"] == 0
    # Mooncake's first requests, lengths scaled x1/32 (prompt) and x1/2 (output), clipped
    from pdserve.bench.traces import trace_requests
    from pdserve.bench.workload import scale_lengths

    first = trace_requests("mooncake-conv")[:6]
    expected = [scale_lengths("mooncake-conv", r.prompt_tokens, r.output_tokens) for r in first]
    assert [(s["prompt_tokens"], s["output_tokens"]) for s in report["samples"]] == expected


def test_trace_of_a_malformed_file_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"request_id": "a", "spans": []}\n')
    proc = run_cli("trace", str(bad))
    assert proc.returncode == 2 and "bad.jsonl:1: not a trace record" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_sweep_writes_every_point_and_the_plots(tmp_path):
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    proc = run_cli(
        "bench",
        "sweep",
        "--model",
        "tiny-llama",
        "--concurrency",
        "1,3",
        "--num-kv-blocks",
        "16",
        "--policy",
        "greedy+recompute,default",
        "--quick",
        "--json",
        str(out),
        "--plot",
        str(plots),
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    fields = {
        "policy",
        "concurrency",
        "throughput_tok_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "tpot_p99_s",
        "preemptions",
        "rotations",
        "recomputed_tokens",
        "generated_tokens",
        "spilled_bytes",
        "goodput_req_s",
        "goodput_tok_s",
        "e2e_p50_s",
        "e2e_p99_s",
    }
    points = report["points"]
    assert [(p["policy"], p["concurrency"]) for p in points] == [
        ("greedy+recompute", 1),
        ("greedy+recompute", 3),
        ("default", 1),
        ("default", 3),
    ]
    assert report["default_policy"] == "cost-aware+tiered"
    for p in points:
        assert fields <= set(p) and p["errors"] == 0 and p["generated_tokens"] > 0
        # --quick: two requests per client, at least three
        assert len(p["requests"]) == p["num_requests"] == max(3, 2 * p["concurrency"])
        assert {"ttft_s", "tpot_s", "e2e_s", "output_tokens"} <= set(p["requests"][0])
        assert sum(r["output_tokens"] for r in p["requests"]) == p["generated_tokens"]
    # the unloaded point meets its own relative SLO (5x TTFT, 2x TPOT) for most requests
    assert points[0]["goodput_req_s"] > 0
    # the default policy's inputs were exported as gauges and scraped: a measured step time
    inputs = points[-1]["policy_inputs"][0]
    assert inputs["step_seconds"] > 0 and inputs["rotation_steps_per_block"] >= 0
    assert {"overcommit_blocks", "demand_blocks", "park_seconds_per_block"} <= set(inputs)
    assert points[0]["policy_inputs"] == [{}]  # greedy exports none
    # the sweep itself asserts that every block and spill tier drained after each point
    for name in ("throughput", "ttft", "tpot", "frontier"):
        assert (plots / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_sweep_runs_an_open_loop_at_each_arrival_rate(tmp_path):
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    proc = run_cli(
        "bench", "sweep", "--model", "tiny-llama", "--rate", "2,8", "--requests-per-rate", "4",
        "--num-kv-blocks", "16", "--policy", "default", "--json", str(out), "--plot", str(plots),
        "--prefill-args", "--turn-s 0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["workload"]["loop"] == "open" and report["workload"]["requests_per_rate"] == 4
    assert report["cluster"]["prefill_args"] == ["--turn-s", "0"]
    points = report["points"]
    assert [(p["rate"], p["concurrency"]) for p in points] == [(2.0, None), (8.0, None)]
    for p in points:
        assert p["errors"] == 0 and p["num_requests"] == 4
        # Poisson arrivals: sent over time, not all at once and not one after another
        sent = sorted(r["sent_s"] for r in p["requests"])
        assert sent[0] == 0 and sent[-1] > 0
        assert sum(r["output_tokens"] for r in p["requests"]) == p["generated_tokens"]
        for r in p["requests"]:  # the longest wait between two tokens, when there were two
            assert (r["max_gap_s"] is None) == (r["output_tokens"] < 2)
            assert r["max_gap_s"] is None or 0 <= r["max_gap_s"] <= r["e2e_s"]
    assert report["slo"]["unloaded_from"]["rate"] == 2.0
    assert report["analysis"]["default"]["knee_rate"] in (2.0, 8.0)
    assert "2/s" in proc.stdout and "8/s" in proc.stdout
    for name in ("throughput", "goodput", "ttft", "tpot", "frontier"):
        assert (plots / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_sweep_takes_clients_or_a_rate_not_both():
    proc = run_cli(
        "bench", "sweep", "--model", "tiny-llama", "--concurrency", "2", "--rate", "1"
    )  # fmt: skip
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr
    proc = run_cli("bench", "sweep", "--model", "tiny-llama", "--rate", "0,1")
    assert proc.returncode == 2 and "positive requests per second" in proc.stderr


def test_bench_sweep_refuses_an_unknown_policy():
    proc = run_cli("bench", "sweep", "--model", "tiny-llama", "--policy", "greedy+pray")
    assert proc.returncode == 2 and "preemption 'pray'" in proc.stderr


def test_bench_tiers_round_trips_every_tier_bit_exact(tmp_path):
    out = tmp_path / "tiers.json"
    proc = run_cli("bench", "tiers", "--model", "tiny-llama", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    # the defaults: the pool on the CPU in float32; tiers as a worker builds them
    assert (report["device"], report["dtype"]) == ("cpu", "float32")
    assert set(report["pinned"]) == {"host", "cxl", "disk"} and not report["pinned"]["disk"]
    assert report["baselines"]["host"] == "tensor copy"
    rows = report["rows"]
    assert sorted((r["tier"], r["layout"], r["blocks"]) for r in rows) == sorted(
        (t, layout, n)
        for t in ("host", "cxl", "disk")
        for layout in ("run", "scattered")
        for n in (1, 6, 32)
    )
    for r in rows:
        assert r["bit_exact"] and r["spill_gb_s"] > 0 and r["reload_gb_s"] > 0
        assert r["raw_write_gb_s"] > 0 and r["raw_read_gb_s"] > 0
        bound = r["bound_of_raw"]
        if r["tier"] == "disk":  # passes in series with the raw move: below raw, always
            assert set(bound) == {"spill", "spill_overlapped", "reload"}
            assert 0 < bound["spill"] < 1 and 0 < bound["reload"] < 1
            assert bound["spill_overlapped"] > bound["spill"]
        else:
            assert set(bound) == {"spill", "reload"} and min(bound.values()) > 0
    assert "bound" in proc.stdout
    assert "float32 on cpu" in proc.stdout


def test_bench_tiers_on_cuda_without_it_is_one_clear_error(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "tiers", "--model", "tiny-llama", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve: error: ") and "CUDA" in err and "not available" in err
    assert main(["bench", "tiers", "--model", "tiny-llama", "--dtype", "fp8"]) == 2
    assert "dtype: 'fp8'; choose auto, float32, float16, bfloat16" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--window", "0"], "window: must be a number of seconds > 0, got 0.0"),
        (["--window", "nan"], "window: must be a number of seconds > 0, got nan"),
        (["--decode", "0"], "a cluster needs a prefill and a decode worker, got 1P0D"),
    ],
)
def test_bench_idle_refuses_bad_input_before_it_launches_anything(flags, says, capsys):
    assert main(["bench", "idle", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"pdserve: error: {says}"


def test_bench_preempt_cost_reports_recompute_and_swap_in_decode_steps(tmp_path):
    out = tmp_path / "cost.json"
    proc = run_cli(
        "bench", "preempt-cost", "--model", "tiny-llama", "--contexts", "32,96",
        "--batch", "3", "--steps", "2", "--reps", "1", "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "recompute ms" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["batch"]) for r in rows] == [(32, 3), (96, 3)]
    for r in rows:
        assert r["decode_step_s"] > 0 and r["recompute_s"] > 0 and r["spill_s"] > 0
        assert r["recompute_steps"] == r["recompute_s"] / r["decode_step_s"]
        assert r["recompute_tokens_lost"] == pytest.approx(3 * r["recompute_steps"])
    assert rows[1]["kv_bytes"] == 3 * rows[0]["kv_bytes"]  # 6 blocks of 16 tokens vs 2


def test_bench_preempt_cost_refuses_bad_contexts():
    proc = run_cli("bench", "preempt-cost", "--model", "tiny-llama", "--contexts", "1")
    assert proc.returncode == 2 and "contexts" in proc.stderr


def test_bench_rescore_applies_another_slo_to_a_sweep_report(tmp_path):
    def point(policy, c, ttft, tpot):
        return {
            "policy": policy,
            "concurrency": c,
            "num_requests": 2,
            "errors": 0,
            "elapsed_s": 10.0,
            "generated_tokens": 20,
            "throughput_tok_s": 2.0,
            "recomputed_tokens": 0,
            "preemptions": 0,
            "spilled_bytes": 0,
            **{
                f"{m}_p{q}_s": v
                for m, v in (("ttft", ttft), ("tpot", tpot), ("e2e", 1.0))
                for q in (50, 99)
            },
            "requests": [{"ttft_s": ttft, "tpot_s": tpot, "e2e_s": 1.0, "output_tokens": 10}] * 2,
        }

    report = {
        "model": "m",
        "cluster": {"prefill": 1, "decode": 1, "num_kv_blocks": 8, "block_size": 16},
        "workload": {"kind": "reasoning", "mean_output": 10},
        "points": [point("a", 1, 0.5, 0.1), point("a", 4, 3.0, 0.1)],
        "analysis": {},
    }
    src, out = tmp_path / "sweep.json", tmp_path / "rescored.json"
    src.write_text(json.dumps(report))
    proc = run_cli("bench", "rescore", str(src), "--slo", "ttft=4,tpot=0.2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert [p["goodput_req_s"] for p in got["points"]] == [0.2, 0.2]
    assert got["slo"]["default"] == {"ttft_s": 4.0, "tpot_s": 0.2, "relative": False}
    assert got["slo"]["tpot-only"]["ttft_s"] is None
    # relative: 5 x 0.5 s TTFT -> the second point's 3 s fails
    proc = run_cli("bench", "rescore", str(src), "--json", str(out))
    assert [p["goodput_req_s"] for p in json.loads(out.read_text())["points"]] == [0.2, 0.0]
    src.write_text(json.dumps({"points": [{"policy": "a"}]}))
    proc = run_cli("bench", "rescore", str(src))
    assert proc.returncode != 0 and "no per-request records" in proc.stderr


def test_workers_take_no_cuda_graphs_into_their_engine_arguments():
    from pdserve.cli import build_parser
    from pdserve.cli.serve import engine_args

    for role in ("prefill", "decode"):
        base = ["serve", role, "--model", "tiny-llama"]
        assert engine_args(build_parser().parse_args(base)).cuda_graphs is True
        args = build_parser().parse_args([*base, "--no-cuda-graphs"])
        assert engine_args(args).cuda_graphs is False


def test_launch_takes_threads_per_role_and_refuses_zero():
    from pdserve.cli import build_parser
    from pdserve.launch import Cluster

    args = build_parser().parse_args(["launch", "--model", "m", "--decode-threads", "3"])
    assert (args.prefill_threads, args.decode_threads, args.share_cpus) == (None, 3, None)
    args = build_parser().parse_args(["launch", "--model", "m", "--share-cpus"])
    assert args.share_cpus is True
    args = build_parser().parse_args(["launch", "--model", "m", "--no-share-cpus"])
    assert args.share_cpus is False
    for flags, want in (([], None), (["--router-idle"], True), (["--no-router-idle"], False)):
        args = build_parser().parse_args(["launch", "--model", "m", *flags])
        assert args.router_idle is want, flags
        for bench in ("parity", "sweep", "serve", "migrate", "chaos", "soak"):
            args = build_parser().parse_args(["bench", bench, *flags])
            assert (args.share_cpus, args.router_idle) == (None, want), (bench, flags)
    with pytest.raises(ValueError, match="decode_threads: 0"):
        Cluster("no-such-model", decode_threads=0)  # before any process starts
    with pytest.raises(ValueError, match="local_prefill_tokens: -1"):
        Cluster("no-such-model", local_prefill_tokens=-1)


def test_the_router_idles_by_default_only_beside_multithreaded_cpu_decode():
    from pdserve.launch import router_idles

    assert router_idles(True, 2) and router_idles(True, 16)
    assert not router_idles(True, 1)  # one thread per decode worker (1P2D on 2 CPUs)
    assert not router_idles(False, 16)  # GPU workers
    # decode workers that compute prompts too step without a gap: the router keeps up
    assert not router_idles(True, 2, local_prefill=True)


def test_workers_share_the_cpus_only_when_they_compute_on_them(monkeypatch):
    import torch

    from pdserve.launch import Cluster, computes_on_cpu

    assert computes_on_cpu(["--device", "cpu"])
    assert not computes_on_cpu(["--device", "cuda:1"])
    assert not computes_on_cpu(["--device", "cpu", "--device=cuda"])  # the last one counts
    assert computes_on_cpu(["--threads", "2", "--dev", "cpu"])  # argparse's abbreviation
    assert not computes_on_cpu(["--device", "cpu", "--dev=cuda:0"])
    for cuda in (False, True):  # "auto" (the default) as a worker resolves it
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert computes_on_cpu(["--threads", "2"]) is not cuda
        assert computes_on_cpu(["--device", "auto"]) is not cuda
        assert computes_on_cpu(["--device"]) is not cuda  # refused by the worker: "auto"
    # insisting on turns for GPU workers fails in the launcher, before any process starts
    with pytest.raises(ValueError, match="share_cpus: only workers that compute on the CPU"):
        Cluster("no-such-model", decode_args=["--device", "cuda"], share_cpus=True)
