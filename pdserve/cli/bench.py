"""`pdserve bench ...`: every benchmark prints a short table, writes JSON with --json, and
states the machine and the comparison it ran in the same process (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import shlex
from types import MappingProxyType

from pdserve.bench.slo import DEFAULT_SWEEP_SLO
from pdserve.cli.common import (
    DEMO_MODEL,
    WORKLOAD_CHOICES,
    int_list,
    print_report,
    rate_list,
    slo_arg,
    sweep_slo_arg,
)


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from pdserve.bench.offline import bench_offline, format_table

    report = bench_offline(
        args.model,
        args.batch_sizes,
        requests_at_batch_1=args.requests_at_batch_1,
        workload=args.workload,
        seed=args.seed,
    )
    return print_report(report, format_table, args.json)


def cmd_bench_tp(args: argparse.Namespace) -> int:
    from pdserve.bench.tp import DEFAULT_MODEL, bench_tp, format_table

    report = bench_tp(
        args.model or DEFAULT_MODEL,
        args.sizes,
        args.batches,
        context=args.context,
        steps=args.steps,
        rounds=args.rounds,
        seed=args.seed,
    )
    return print_report(report, format_table, args.json)


def cmd_bench_migrate(args: argparse.Namespace) -> int:
    from pdserve.bench.migrate import bench_migrate, format_table

    report = bench_migrate(
        args.model,
        args.contexts,
        args.before,
        args.after,
        args.repeats,
        args.seed,
        args.cold,
        args.decode_tp,
        share_cpus=args.share_cpus,
        router_idle=args.router_idle,
    )
    return print_report(report, format_table, args.json)


def cmd_bench_idle(args: argparse.Namespace) -> int:
    from pdserve.bench.idle import bench_idle, format_table

    report = bench_idle(
        args.model,
        args.prefill,
        args.decode,
        window_s=args.window,
        transfer=args.transfer,
        share_cpus=args.share_cpus,
        router_idle=args.router_idle,
    )
    return print_report(report, format_table, args.json)


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    from pdserve.bench.kernels import bench_kernels, format_table

    report = bench_kernels(quick=args.quick, tiles=args.tiles)
    return print_report(report, format_table, args.json)


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    from pdserve.bench.transfer import bench_transfer, format_table

    report = bench_transfer(args.model, args.backend, quick=args.quick)
    return print_report(report, format_table, args.json)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from pdserve.bench.serve import bench_serve, format_table

    worker_args = ["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else None
    report = bench_serve(
        args.model,
        address=args.address,
        prefill=args.prefill,
        decode=args.decode,
        requests=args.requests,
        concurrency=args.concurrency,
        rate=args.rate,
        workload=args.workload,
        seed=args.seed,
        worker_args=worker_args,
        replay=args.replay,
        time_scale=args.time_scale,
        trace_path=args.trace,
        slo=args.slo,
        share_cpus=args.share_cpus,
        router_idle=args.router_idle,
    )
    if args.trace:
        print(f"wrote per-request traces to {args.trace} (plot: pdserve trace {args.trace} --plot)")
    return print_report(report, format_table, args.json)


def cmd_bench_openai(args: argparse.Namespace) -> int:
    from pdserve.bench.openai_load import bench_openai, format_table

    api_key = None
    if args.api_key_file:
        with open(args.api_key_file) as f:
            api_key = f.readline().strip()
    report = bench_openai(
        args.url,
        args.model,
        tuple(args.concurrency),
        max_tokens=args.max_tokens,
        requests=args.requests,
        api=args.api,
        api_key=api_key,
        seed=args.seed,
        slo=args.slo,
    )
    return print_report(report, format_table, args.json)


def cmd_bench_parity(args: argparse.Namespace) -> int:
    from pdserve.bench.parity import bench_parity, format_table

    report = bench_parity(
        args.model,
        tuple(args.concurrency),
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        threads=args.threads,
        seed=args.seed,
        share_cpus=args.share_cpus,
        router_idle=args.router_idle,
    )
    return print_report(report, format_table, args.json)


def cmd_bench_roofline(args: argparse.Namespace) -> int:
    from pdserve.bench.roofline import bench_roofline, format_table

    report = bench_roofline(
        args.model, tuple(args.batches), tuple(args.contexts), steps=args.steps, seed=args.seed
    )
    return print_report(report, format_table, args.json)


def cmd_bench_fuzz(args: argparse.Namespace) -> int:
    from pdserve.bench.fuzz import bench_fuzz, format_table, ok

    report = bench_fuzz(args.model, inputs=args.inputs, seed=args.seed, threads=args.threads)
    print_report(report, format_table, args.json)
    return 0 if ok(report) else 1


def fault_patterns(text: str) -> list[str]:
    """A fault name or a shell pattern -> the faults it names (in catalogue order)."""
    import fnmatch

    from pdserve.bench.faults import FAULTS

    names = [f for f in FAULTS if fnmatch.fnmatchcase(f, text)]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no fault; see --help for the list")
    return names


def cmd_bench_chaos(args: argparse.Namespace) -> int:
    from pdserve.bench.chaos import bench_chaos, format_table, ok

    report = bench_chaos(
        args.model,
        faults=tuple(dict.fromkeys(f for group in args.faults for f in group)),
        requests=args.requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        seed=args.seed,
        share_cpus=args.share_cpus,
        router_idle=args.router_idle,
    )
    print_report(report, format_table, args.json)
    return 0 if ok(report) else 1


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from pdserve.bench.chaos import format_table, ok
    from pdserve.bench.soak import bench_soak

    report = bench_soak(
        args.model,
        requests=args.requests,
        concurrency=args.concurrency,
        kill_every=args.kill_every,
        seed=args.seed,
        share_cpus=args.share_cpus,
        router_idle=args.router_idle,
    )
    print_report(report, format_table, args.json)
    return 0 if ok(report) else 1


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    from pdserve.bench.tiers import bench_tiers, format_table

    report = bench_tiers(args.model, quick=args.quick, device=args.device, dtype=args.dtype)
    return print_report(report, format_table, args.json)


def cmd_bench_preempt_cost(args: argparse.Namespace) -> int:
    from pdserve.bench.preempt_cost import bench_preempt_cost, format_table

    report = bench_preempt_cost(
        args.model, tuple(args.contexts), batch=args.batch, steps=args.steps, reps=args.reps
    )
    return print_report(report, format_table, args.json)


# bench sweep's defaults, and --quick's (under 5 minutes on 2 cores): every point has at least
# two requests per client, or the busy window ends at the first completion
FULL_SWEEP = MappingProxyType(
    {
        "concurrency": (1, 2, 4, 8, 16),
        "num_kv_blocks": 48,
        "policy": "greedy+recompute,greedy+tiered,default",
        "requests_per_client": 3,
        "min_requests": 4,
    }
)
QUICK_SWEEP = MappingProxyType(
    {
        "concurrency": (1, 8),
        "num_kv_blocks": 16,
        "policy": "greedy+recompute,default",
        "requests_per_client": 2,
        "min_requests": 3,
    }
)


def cmd_bench_sweep(args: argparse.Namespace) -> int:
    from pdserve.bench.report import write_json
    from pdserve.bench.sweep import bench_sweep, format_table
    from pdserve.bench.sweep_plots import plot_sweep

    # --quick: fewer, smaller points unless asked otherwise (a pool of 16 blocks fills at a
    # few clients, so the trap still shows), today's behaviour against the default
    quick = QUICK_SWEEP if args.quick else FULL_SWEEP
    concurrency = None if args.rate else (args.concurrency or list(quick["concurrency"]))
    num_kv_blocks = args.num_kv_blocks or quick["num_kv_blocks"]
    policies = [p for p in (args.policy or quick["policy"]).split(",") if p]
    report = bench_sweep(
        args.model,
        policies,
        concurrency,
        prefill=args.prefill,
        decode=args.decode,
        num_kv_blocks=num_kv_blocks,
        requests_per_client=args.requests_per_client or quick["requests_per_client"],
        min_requests=quick["min_requests"],
        mean_output=args.mean_output,
        max_output=args.max_output,
        seed=args.seed,
        spill_dir=args.spill_dir,
        workload=args.workload,
        slo=args.slo,
        partial_json=args.json,
        rates=args.rate,
        requests_per_rate=args.requests_per_rate,
        skew=args.skew,
        share_cpus=args.share_cpus,
        router_idle=args.router_idle,
        prefill_args=shlex.split(args.prefill_args),
    )
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        for path in plot_sweep(report, args.plot):
            print(f"wrote {path}")
    return 0


def cmd_bench_rescore(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from pdserve.bench.slo import parse_slo
    from pdserve.bench.sweep import format_table, rescore

    try:
        report = json.loads(Path(args.report).read_text())
        points = report["points"]
        if not points or "requests" not in points[0] or not isinstance(points[0]["requests"], list):
            raise ValueError("it has no per-request records (written by an older sweep?)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"pdserve: error: report: {args.report}: {e}") from None
    return print_report(
        rescore(report, args.slo or parse_slo(DEFAULT_SWEEP_SLO)), format_table, args.json
    )


def cmd_bench_sim_vs_real(args: argparse.Namespace) -> int:
    from pdserve.sim.profile import load_profile
    from pdserve.sim.vs_real import bench_sim_vs_real, format_table

    report = bench_sim_vs_real(
        args.model,
        load_profile(args.profile),
        concurrencies=tuple(args.concurrency),
        num_kv_blocks=args.num_kv_blocks,
        requests=args.requests,
        mean_output=args.mean_output,
        seed=args.seed,
        cluster=args.cluster,
        decode_workers=args.decode_workers,
        engine=not args.no_engine,
        rescale=args.rescale,
        repeat=args.repeat,
    )
    return print_report(report, format_table, args.json)


def add_cpu_flags(p: argparse.ArgumentParser) -> None:
    """How a benchmark's launched clusters use this node's CPUs (pdserve launch's flags)."""
    p.add_argument(
        "--share-cpus",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the cluster's workers on every CPU, in turns, or (--no-share-cpus) on an even "
        "split (default: as launch does)",
    )
    p.add_argument(
        "--router-idle",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the router at idle scheduling priority (default: as launch does)",
    )


def add_bench_parser(sub) -> None:
    from transfer import PROCESS_BACKENDS

    bench = sub.add_parser("bench", help="benchmarks (JSON out, table to stdout)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    off = bench_sub.add_parser("offline", help="LLM.generate vs transformers generate")
    off.add_argument("--model", default=DEMO_MODEL)
    off.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32])
    off.add_argument("--requests-at-batch-1", type=int, default=4)
    off.add_argument("--workload", default="azure-conv", choices=WORKLOAD_CHOICES)
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--json", default=None, help="write the report here")
    off.set_defaults(func=cmd_bench_offline)

    tp = bench_sub.add_parser("tp", help="decode step times at TP=1 vs TP=k (one process)")
    tp.add_argument("--model", default=None, help="default: Qwen2.5-0.5B's shape, random weights")
    tp.add_argument("--sizes", type=int_list, default=[1, 2])
    tp.add_argument("--batches", type=int_list, default=[1, 8])
    tp.add_argument("--context", type=int, default=256)
    tp.add_argument("--steps", type=int, default=8, help="decode steps per request per round")
    tp.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument("--json", default=None, help="write the report here")
    tp.set_defaults(func=cmd_bench_tp)

    mig = bench_sub.add_parser(
        "migrate", help="the stall a live KV migration costs a stream (1P2D, launched)"
    )
    mig.add_argument("--model", default="smollm2-135m")
    mig.add_argument("--contexts", type=int_list, default=[256, 1024, 2048])
    mig.add_argument("--before", type=int, default=32, help="tokens streamed before the move")
    mig.add_argument("--after", type=int, default=32, help="tokens streamed after it")
    mig.add_argument("--repeats", type=int, default=2)
    mig.add_argument("--seed", type=int, default=0)
    mig.add_argument("--cold", type=int, default=2, help="first moves reported apart")
    mig.add_argument(
        "--decode-tp", type=int, default=1, help="ranks per decode worker (tensor parallel)"
    )
    mig.add_argument("--json", default=None, help="write the report here")
    add_cpu_flags(mig)
    mig.set_defaults(func=cmd_bench_migrate)
    kern = bench_sub.add_parser("kernels", help="decode/KV kernels against the memory roofline")
    kern.add_argument("--quick", action="store_true", help="a small sweep (CPU-sized)")
    kern.add_argument(
        "--tiles", action="store_true", help="also every decode kernel tile (GPU, full grid)"
    )
    kern.add_argument("--json", default=None, help="write the report here")
    kern.set_defaults(func=cmd_bench_kernels)

    xfer = bench_sub.add_parser("transfer", help="KV handoff vs raw NIXL, layer-wise TTFT")
    xfer.add_argument("--model", default=DEMO_MODEL)
    xfer.add_argument("--backend", default="nixl")
    xfer.add_argument("--quick", action="store_true")
    xfer.add_argument("--json", default=None)
    xfer.set_defaults(func=cmd_bench_transfer)

    srv = bench_sub.add_parser("serve", help="load generator against a router")
    srv.add_argument("--model", default=DEMO_MODEL)
    srv.add_argument("--address", default=None, help="an existing router; else one is launched")
    srv.add_argument("--prefill", type=int, default=1)
    srv.add_argument("--decode", type=int, default=1)
    srv.add_argument("--num-kv-blocks", type=int, default=None)
    srv.add_argument("--requests", type=int, default=32)
    srv.add_argument("--concurrency", type=int, default=8)
    srv.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    srv.add_argument("--workload", default="azure-conv", choices=WORKLOAD_CHOICES)
    srv.add_argument("--replay", action="store_true", help="use the trace's arrival times")
    srv.add_argument("--time-scale", type=float, default=1.0, help="replay N times faster")
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--json", default=None)
    srv.add_argument("--trace", default=None, help="write each request's spans (JSON lines)")
    srv.add_argument(
        "--slo", type=slo_arg, default=None, help="ttft=SECONDS,tpot=SECONDS (default 2, 0.1)"
    )
    add_cpu_flags(srv)
    srv.set_defaults(func=cmd_bench_serve)

    oai = bench_sub.add_parser(
        "openai", help="the same streaming load against any OpenAI-compatible server"
    )
    oai.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    oai.add_argument("--model", required=True, help="the model name the server serves")
    oai.add_argument("--concurrency", type=int_list, default=[1, 16, 32])
    oai.add_argument("--max-tokens", type=int, default=128)
    oai.add_argument("--requests", type=int, default=None, help="per point (default: 2c, >= 4)")
    oai.add_argument("--api", choices=["chat", "completions"], default="chat")
    oai.add_argument("--api-key-file", default=None, help="a file whose first line is the key")
    oai.add_argument("--seed", type=int, default=0)
    oai.add_argument(
        "--slo", type=slo_arg, default=None, help="ttft=SECONDS,tpot=SECONDS (default 2, 0.1)"
    )
    oai.add_argument("--json", default=None)
    oai.set_defaults(func=cmd_bench_openai)

    par = bench_sub.add_parser(
        "parity", help="a 1P1D cluster vs the in-process engine, same requests and threads"
    )
    par.add_argument("--model", default=DEMO_MODEL)
    par.add_argument("--concurrency", type=int_list, default=[8, 16, 32])
    par.add_argument("--max-tokens", type=int, default=128)
    par.add_argument("--rounds", type=int, default=2, help="interleaved A/B rounds")
    par.add_argument("--threads", type=int, default=None, help="torch threads (default: CPUs)")
    add_cpu_flags(par)
    par.add_argument("--seed", type=int, default=0)
    par.add_argument("--json", default=None)
    par.set_defaults(func=cmd_bench_parity)

    idle = bench_sub.add_parser(
        "idle", help="the CPU each process of a launched cluster uses while it serves nothing"
    )
    idle.add_argument("--model", default="tiny-llama")
    idle.add_argument("--prefill", type=int, default=1)
    idle.add_argument("--decode", type=int, default=2)
    idle.add_argument("--window", type=float, default=30.0, help="seconds measured, idle")
    idle.add_argument("--transfer", default="nixl", choices=PROCESS_BACKENDS)
    add_cpu_flags(idle)
    idle.add_argument("--json", default=None)
    idle.set_defaults(func=cmd_bench_idle)

    roof = bench_sub.add_parser(
        "roofline", help="decode step time against the memory roofline, measured here"
    )
    roof.add_argument("--model", default=DEMO_MODEL)
    roof.add_argument("--batches", type=int_list, default=[1, 8, 16, 32, 64])
    roof.add_argument("--contexts", type=int_list, default=[128, 512, 1024, 2048])
    roof.add_argument("--steps", type=int, default=3, help="timed steps per point (median)")
    roof.add_argument("--seed", type=int, default=0)
    roof.add_argument("--json", default=None)
    roof.set_defaults(func=cmd_bench_roofline)

    fz = bench_sub.add_parser(
        "fuzz", help="generated bad input at every RPC and the HTTP API of a launched cluster"
    )
    fz.add_argument("--model", default="tiny-llama")
    fz.add_argument("--inputs", type=int, default=10_000)
    fz.add_argument("--seed", type=int, default=0)
    fz.add_argument("--threads", type=int, default=8, help="calls in flight at once")
    fz.add_argument("--json", default=None)
    fz.set_defaults(func=cmd_bench_fuzz)

    from pdserve.bench.faults import FAULT_HELP, FAULTS

    ch = bench_sub.add_parser(
        "chaos",
        help="one fault at a time (kill, freeze, restart, cancel) under load on a launched "
        "2P2D cluster: lost, hung, duplicated, leaked, equal to the fault-free run",
    )
    ch.add_argument("--model", default="tiny-llama")
    ch.add_argument(
        "--faults",
        nargs="+",
        type=fault_patterns,
        default=[list(FAULTS)],
        metavar="FAULT",
        help="names or shell patterns ('decode-*@spill', 'cancel@*'), default all: "
        + "; ".join(f"{k}: {v}" for k, v in FAULT_HELP.items()),
    )
    ch.add_argument("--requests", type=int, default=24, help="per fault")
    ch.add_argument("--concurrency", type=int, default=8)
    ch.add_argument("--max-tokens", type=int, default=48)
    ch.add_argument("--seed", type=int, default=0)
    ch.add_argument("--json", default=None)
    add_cpu_flags(ch)
    ch.set_defaults(func=cmd_bench_chaos)

    so = bench_sub.add_parser(
        "soak", help="many requests while workers are killed and restarted; RSS sampled"
    )
    so.add_argument("--model", default="tiny-llama")
    so.add_argument("--requests", type=int, default=2000)
    so.add_argument("--concurrency", type=int, default=16)
    so.add_argument("--kill-every", type=int, default=200, help="requests between kills")
    so.add_argument("--seed", type=int, default=0)
    so.add_argument("--json", default=None)
    add_cpu_flags(so)
    so.set_defaults(func=cmd_bench_soak)

    ti = bench_sub.add_parser("tiers", help="spill/reload throughput per tier vs raw moves")
    ti.add_argument("--model", default=DEMO_MODEL)
    ti.add_argument("--quick", action="store_true")
    ti.add_argument(
        "--device",
        default="cpu",
        help="where the KV pool lives: cpu, cuda or cuda:N (the host tier's memory is pinned "
        "on a CUDA machine, as a worker's)",
    )
    ti.add_argument(
        "--dtype",
        default="auto",
        help="the pool's dtype: float32, float16, bfloat16 or auto (float32 on CPU, bfloat16 on "
        "CUDA)",
    )
    ti.add_argument("--json", default=None)
    ti.set_defaults(func=cmd_bench_tiers)

    pc = bench_sub.add_parser(
        "preempt-cost", help="one preemption's cost in decode steps: recompute vs spill+reload"
    )
    pc.add_argument("--model", default=DEMO_MODEL)
    pc.add_argument("--contexts", type=int_list, default=[256, 1024, 2048])
    pc.add_argument("--batch", type=int, default=8, help="requests in the decode batch")
    pc.add_argument("--steps", type=int, default=5, help="decode steps timed per context")
    pc.add_argument("--reps", type=int, default=3)
    pc.add_argument("--json", default=None)
    pc.set_defaults(func=cmd_bench_preempt_cost)

    sw = bench_sub.add_parser("sweep", help="throughput, latency and goodput vs load, per policy")
    sw.add_argument("--model", default=DEMO_MODEL)
    load = sw.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=int_list,
        default=None,
        help="closed-loop clients per point; default 1,2,4,8,16 (--quick: 1,8)",
    )
    load.add_argument(
        "--rate",
        type=rate_list,
        default=None,
        help="open loop instead: Poisson arrivals per second per point, e.g. 0.1,0.2,0.4",
    )
    sw.add_argument(
        "--policy",
        default=None,
        help="comma-separated admission+preemption pairs, each with +migrate for the "
        "router's live-migration rebalancer (e.g. kv-aware+tiered+migrate); `default` is what "
        "a decode worker runs when given no policy flags (default greedy+recompute,"
        "greedy+tiered,default; --quick: greedy+recompute,default)",
    )
    add_cpu_flags(sw)
    sw.add_argument(
        "--skew",
        default=None,
        choices=("late-join", "scale-out"),
        help="unbalanced arrivals (2+ decode workers): all but one decode worker join only "
        "after half of each point's requests were sent (late-join) or once the first wave, "
        "one request per client, streams on the first (scale-out)",
    )
    sw.add_argument(
        "--workload",
        default="reasoning",
        choices=WORKLOAD_CHOICES,
        help="reasoning and long-prompt scale their outputs to the KV budget",
    )
    sw.add_argument(
        "--slo",
        type=sweep_slo_arg,
        default=None,
        help=f"ttft=SECONDS,tpot=SECONDS, or multiples of the unloaded p50s "
        f"(default {DEFAULT_SWEEP_SLO})",
    )
    sw.add_argument("--prefill", type=int, default=1)
    sw.add_argument("--decode", type=int, default=1)
    sw.add_argument(
        "--num-kv-blocks", type=int, default=None, help="per decode worker (default 48; --quick 16)"
    )
    sw.add_argument(
        "--mean-output",
        type=int,
        default=None,
        help="mean output tokens (default: a quarter of the KV budget)",
    )
    sw.add_argument(
        "--max-output",
        type=int,
        default=None,
        help="longest output (default: what leaves the longest prompt half the KV budget)",
    )
    sw.add_argument(
        "--requests-per-client", type=int, default=None, help="closed loop (default 3; --quick 2)"
    )
    sw.add_argument(
        "--requests-per-rate", type=int, default=48, help="open loop: requests per point"
    )
    sw.add_argument("--spill-dir", default=None)
    sw.add_argument(
        "--prefill-args",
        default="",
        metavar="FLAGS",
        help="flags for every prefill worker, one string (e.g. --prefill-args='--turn-s 0'); "
        "recorded in the JSON",
    )
    sw.add_argument(
        "--quick",
        action="store_true",
        help="a few minutes: 1 and 8 clients, 16 blocks, greedy+recompute against the default",
    )
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--json", default=None)
    sw.add_argument("--plot", default=None, help="directory for the PNG plots")
    sw.set_defaults(func=cmd_bench_sweep)

    rs = bench_sub.add_parser(
        "rescore", help="a sweep's goodput again under another SLO, from its request records"
    )
    rs.add_argument("report", help="a bench sweep JSON report")
    rs.add_argument("--slo", type=sweep_slo_arg, default=None, help=f"default {DEFAULT_SWEEP_SLO}")
    rs.add_argument("--json", default=None)
    rs.set_defaults(func=cmd_bench_rescore)

    svr = bench_sub.add_parser(
        "sim-vs-real", help="the simulator against real runs of the engine (and a cluster)"
    )
    svr.add_argument("--model", default=DEMO_MODEL)
    svr.add_argument("--profile", required=True, help="this machine's (pdserve sim calibrate)")
    svr.add_argument("--concurrency", type=int_list, default=[2, 8, 16])
    svr.add_argument("--num-kv-blocks", type=int, default=32)
    svr.add_argument("--requests", type=int, default=16, help="at least, per point")
    svr.add_argument("--mean-output", type=int, default=None)
    svr.add_argument("--cluster", action="store_true", help="also a launched 1P1D cluster")
    svr.add_argument(
        "--decode-workers", type=int, default=1, help="of the cluster (2: 1P2D; with --cluster)"
    )
    svr.add_argument("--no-engine", action="store_true", help="the cluster half only")
    svr.add_argument(
        "--rescale",
        action="store_true",
        help="scale the profile's engine step costs by the engine's probes (made before, "
        "between and after the policies' points; each point's factor interpolated at its "
        "time), and each launched cluster's decode and prefill costs by that cluster's own "
        "probe (the figures with the profile as given are reported too)",
    )
    svr.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each point's real half this many times (rounds of the loads in turn); the "
        "first is the comparison, and each miss says whether it is the real runs' "
        "disagreement (no single figure is within the bound of every run, and the simulated "
        "one is within it of as many as any could be) or the model's error",
    )
    svr.add_argument("--seed", type=int, default=0)
    svr.add_argument("--json", default=None)
    svr.set_defaults(func=cmd_bench_sim_vs_real)
