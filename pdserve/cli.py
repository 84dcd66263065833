"""The `pdserve` command line.

pdserve generate --model M --prompt "..." [--chat] [--max-tokens N] [--temperature T]
pdserve bench offline --model M [--batch-sizes 1,8,32] [--workload azure-conv] --json out.json
pdserve bench kernels [--quick] --json out.json
pdserve bench transfer [--model M] [--quick] --json out.json
pdserve bench serve [--model M] [--concurrency N | --rate R] --json out.json [--trace t.jsonl]
pdserve trace t.jsonl --plot timeline.png
pdserve bench tiers [--quick] --json out.json
pdserve bench sweep [--quick] --concurrency 1,2,4,8 --policy greedy+recompute,kv-aware+tiered
    --json out.json --plot DIR
pdserve launch --model M --prefill N --decode M
pdserve serve router|prefill|decode --model M ...
pdserve demo
"""

from __future__ import annotations

import argparse
import sys

DEMO_MODEL = "smollm2-135m"
DEMO_KV_BLOCKS = 24
DEMO_CONCURRENCY = (1, 4, 16)
WORKLOAD_CHOICES = ("azure-conv", "azure-code", "mooncake-conv", "uniform", "reasoning")
DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _report(report: dict, format_table, json_path: str | None) -> int:
    """Every bench prints its table and, when asked, writes its JSON report."""
    from pdserve.bench.report import write_json

    print(format_table(report))
    if json_path:
        write_json(report, json_path)
        print(f"wrote {json_path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=args.max_model_len)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text if llm.tokenizer is not None else out.token_ids)
    return 0


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from pdserve.bench.offline import bench_offline, format_table

    report = bench_offline(
        args.model,
        args.batch_sizes,
        requests_at_batch_1=args.requests_at_batch_1,
        workload=args.workload,
        seed=args.seed,
    )
    return _report(report, format_table, args.json)


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    from pdserve.bench.kernels import bench_kernels, format_table

    report = bench_kernels(quick=args.quick)
    return _report(report, format_table, args.json)


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    from pdserve.bench.transfer import bench_transfer, format_table

    report = bench_transfer(args.model, args.backend, quick=args.quick)
    return _report(report, format_table, args.json)


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
    )
    if args.trace:
        print(f"wrote per-request traces to {args.trace} (plot: pdserve trace {args.trace} --plot)")
    return _report(report, format_table, args.json)


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    from pdserve.bench.tiers import bench_tiers, format_table

    return _report(bench_tiers(args.model, quick=args.quick), format_table, args.json)


def cmd_bench_preempt_cost(args: argparse.Namespace) -> int:
    from pdserve.bench.preempt_cost import bench_preempt_cost, format_table

    report = bench_preempt_cost(
        args.model, tuple(args.contexts), batch=args.batch, steps=args.steps, reps=args.reps
    )
    return _report(report, format_table, args.json)


def cmd_bench_sweep(args: argparse.Namespace) -> int:
    from pdserve.bench.report import write_json
    from pdserve.bench.sweep import bench_sweep, format_table
    from pdserve.bench.sweep_plots import plot_sweep

    concurrency = args.concurrency
    policies = [p for p in args.policy.split(",") if p]
    report = bench_sweep(
        args.model,
        policies,
        concurrency,
        prefill=args.prefill,
        decode=args.decode,
        num_kv_blocks=args.num_kv_blocks,
        requests_per_client=1 if args.quick else args.requests_per_client,
        min_requests=3 if args.quick else 4,
        mean_output=args.mean_output,
        seed=args.seed,
        spill_dir=args.spill_dir,
    )
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        for path in plot_sweep(report, args.plot):
            print(f"wrote {path}")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from pdserve.bench.timeline import plot_timeline, stage_table
    from pdserve.trace import read_jsonl

    records = read_jsonl(args.file)
    if not records:
        raise ValueError(f"{args.file}: no trace records")
    print(stage_table(records))
    if args.plot:
        plot_timeline(records, args.plot, args.max_requests)
        print(f"wrote {args.plot}")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from pdserve.launch import run_launch

    return run_launch(args)


def cmd_demo(args: argparse.Namespace) -> int:
    """The capacity trap on a laptop-sized budget: a 1P2D SmolLM2 cluster whose decode workers
    hold only DEMO_KV_BLOCKS blocks each, swept over concurrency with today's policy and ours."""
    from pdserve import LLM, SamplingParams
    from pdserve.bench.report import write_json
    from pdserve.bench.sweep import bench_sweep, format_table
    from pdserve.bench.sweep_plots import plot_sweep

    print(f"== {DEMO_MODEL}: one answer from the colocated engine (SmolLM2-135M, GGUF)")
    llm = LLM(DEMO_MODEL)
    out = llm.chat(
        [{"role": "user", "content": DEMO_QUESTIONS[0]}],
        SamplingParams(max_tokens=32, temperature=0),
    )[0]
    print(f"> {DEMO_QUESTIONS[0]}\n{out.text.strip()}\n")
    del llm
    print(
        f"== the capacity trap: 1 prefill + 2 decode worker processes, {DEMO_KV_BLOCKS} KV blocks "
        f"of 16 tokens per decode worker, reasoning workload (long-tailed outputs), closed-loop "
        f"clients at concurrency {','.join(map(str, DEMO_CONCURRENCY))}; each policy launches "
        f"its own cluster (~1 min to start on 2 cores)"
    )
    report = bench_sweep(
        DEMO_MODEL,
        ["greedy+recompute", "kv-aware+tiered"],
        list(DEMO_CONCURRENCY),
        prefill=1,
        decode=2,
        num_kv_blocks=DEMO_KV_BLOCKS,
        requests_per_client=1,
        min_requests=3,
    )
    print(format_table(report))
    write_json(report, args.json)
    print(f"wrote {args.json}")
    for path in plot_sweep(report, args.plot):
        print(f"wrote {path}")
    print("what the plots show: docs/capacity-trap.md")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion with the colocated engine")
    gen.add_argument("--model", required=True, help="preset, checkpoint directory or .gguf")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks (JSON out, table to stdout)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    off = bench_sub.add_parser("offline", help="LLM.generate vs transformers generate")
    off.add_argument("--model", default=DEMO_MODEL)
    off.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32])
    off.add_argument("--requests-at-batch-1", type=int, default=4)
    off.add_argument("--workload", default="azure-conv", choices=WORKLOAD_CHOICES)
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--json", default=None, help="write the report here")
    off.set_defaults(func=cmd_bench_offline)

    kern = bench_sub.add_parser("kernels", help="decode/KV kernels against the memory roofline")
    kern.add_argument("--quick", action="store_true", help="a small sweep (CPU-sized)")
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
    srv.set_defaults(func=cmd_bench_serve)

    ti = bench_sub.add_parser("tiers", help="spill/reload throughput per tier vs raw moves")
    ti.add_argument("--model", default=DEMO_MODEL)
    ti.add_argument("--quick", action="store_true")
    ti.add_argument("--json", default=None)
    ti.set_defaults(func=cmd_bench_tiers)

    pc = bench_sub.add_parser(
        "preempt-cost", help="one preemption's cost in decode steps: recompute vs spill+reload"
    )
    pc.add_argument("--model", default=DEMO_MODEL)
    pc.add_argument("--contexts", type=_int_list, default=[256, 1024, 2048])
    pc.add_argument("--batch", type=int, default=8, help="requests in the decode batch")
    pc.add_argument("--steps", type=int, default=5, help="decode steps timed per context")
    pc.add_argument("--reps", type=int, default=3)
    pc.add_argument("--json", default=None)
    pc.set_defaults(func=cmd_bench_preempt_cost)

    sw = bench_sub.add_parser("sweep", help="throughput and latency vs concurrency per policy")
    sw.add_argument("--model", default=DEMO_MODEL)
    sw.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8, 16])
    sw.add_argument(
        "--policy",
        default="greedy+recompute,kv-aware+tiered",
        help="comma-separated admission+preemption pairs",
    )
    sw.add_argument("--prefill", type=int, default=1)
    sw.add_argument("--decode", type=int, default=1)
    sw.add_argument("--num-kv-blocks", type=int, default=48, help="per decode worker")
    sw.add_argument(
        "--mean-output",
        type=int,
        default=None,
        help="mean output tokens (default: a quarter of the KV budget)",
    )
    sw.add_argument("--requests-per-client", type=int, default=3)
    sw.add_argument("--spill-dir", default=None)
    sw.add_argument("--quick", action="store_true", help="one request per client per point")
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--json", default=None)
    sw.add_argument("--plot", default=None, help="directory for the PNG plots")
    sw.set_defaults(func=cmd_bench_sweep)

    tr = sub.add_parser("trace", help="summarize and plot per-request traces")
    tr.add_argument("file", help="JSON lines from `pdserve bench serve --trace`")
    tr.add_argument("--plot", default=None, help="write a timeline PNG here")
    tr.add_argument("--max-requests", type=int, default=64, help="rows in the timeline")
    tr.set_defaults(func=cmd_trace)

    from pdserve.serving.roles import add_serve_parser

    add_serve_parser(sub)
    launch = sub.add_parser("launch", help="a local cluster of separate processes")
    launch.add_argument("--model", required=True)
    launch.add_argument("--prefill", type=int, default=1)
    launch.add_argument("--decode", type=int, default=1)
    launch.add_argument("--port", type=int, default=0)
    launch.add_argument("--transfer", default="nixl", help="nixl | ucxx | loopback")
    launch.add_argument(
        "--http-port", type=int, default=None, help="OpenAI-compatible HTTP API port (0: free)"
    )
    launch.add_argument("--num-kv-blocks", type=int, default=None)
    launch.set_defaults(func=cmd_launch)

    demo = sub.add_parser("demo", help="SmolLM2 answers, then the capacity-trap sweep")
    demo.add_argument("--json", default="out/demo-sweep.json")
    demo.add_argument("--plot", default="out/demo-plots")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
