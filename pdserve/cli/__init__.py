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
pdserve bench sim-vs-real --profile PROFILE.json [--cluster] --json out.json
pdserve sim --model M [--profile h200] --policy P1,P2 --concurrency 1,8,64 --json out.json
pdserve sim calibrate --model M [--cluster] --json PROFILE.json
pdserve plan --model CONFIG --gpu h200 --gpus 8 --workload azure-conv --slo ttft=2,tpot=0.05
pdserve launch --model M --prefill N --decode M [--tls-cert C --tls-key K --tls-ca CA]
pdserve certs DIR --host 10.0.0.1 --host node1 (a CA and a member certificate for TLS)
pdserve serve router|prefill|decode --model M ...
pdserve drain WORKER_ID --router HOST:PORT (move its requests to the other decode workers)
pdserve demo
"""

from __future__ import annotations

import argparse
import sys

from pdserve.cli.bench import add_bench_parser
from pdserve.cli.common import add_memory_flags
from pdserve.cli.demo import add_demo_parser
from pdserve.cli.drain import add_drain_parser
from pdserve.cli.plan import add_plan_parser
from pdserve.cli.serve import add_serve_parser
from pdserve.cli.sim import add_sim_parser


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


def cmd_certs(args: argparse.Namespace) -> int:
    from pdserve.serving.certs import make_certs

    for path in make_certs(args.dir, args.host, args.days).values():
        print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from transfer import PROCESS_BACKENDS

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

    add_bench_parser(sub)

    tr = sub.add_parser("trace", help="summarize and plot per-request traces")
    tr.add_argument("file", help="JSON lines from `pdserve bench serve --trace`")
    tr.add_argument("--plot", default=None, help="write a timeline PNG here")
    tr.add_argument("--max-requests", type=int, default=64, help="rows in the timeline")
    tr.set_defaults(func=cmd_trace)

    add_serve_parser(sub)
    add_sim_parser(sub)
    add_plan_parser(sub)
    launch = sub.add_parser("launch", help="a local cluster of separate processes")
    launch.add_argument("--model", required=True)
    launch.add_argument("--prefill", type=int, default=1)
    launch.add_argument("--decode", type=int, default=1)
    launch.add_argument(
        "--prefill-tp", type=int, default=1, help="tensor-parallel ranks of each prefill worker"
    )
    launch.add_argument(
        "--decode-tp", type=int, default=1, help="tensor-parallel ranks of each decode worker"
    )
    for role in ("prefill", "decode"):
        launch.add_argument(
            f"--{role}-threads",
            type=int,
            default=None,
            help=f"torch threads of each {role} worker (default: every CPU when the workers "
            "share them in turns, else the CPUs split evenly over every worker's ranks; "
            "docs/benchmarks.md)",
        )
    launch.add_argument(
        "--share-cpus",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each worker's threads span every CPU and the workers compute in turns (a "
        "forward pass each) instead of splitting the CPUs (default: on when the workers "
        "compute on the CPU; --no-share-cpus splits them; docs/benchmarks.md)",
    )
    launch.add_argument(
        "--router-idle",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the router runs at Linux's idle scheduling priority, yielding the CPUs to the "
        "workers' compute (default: on when the workers compute on the CPU, each decode "
        "rank on more than one thread; docs/benchmarks.md)",
    )
    launch.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=0,
        metavar="N",
        help="the router's --local-prefill-tokens: prompts of at most N tokens are computed by "
        "their decode worker (conditional disaggregation; default 0: none); with N > 0 the "
        "router stays at normal priority unless --router-idle",
    )
    launch.add_argument("--port", type=int, default=0)
    launch.add_argument("--transfer", default="nixl", choices=PROCESS_BACKENDS)
    launch.add_argument(
        "--http-port", type=int, default=None, help="OpenAI-compatible HTTP API port (0: free)"
    )
    launch.add_argument("--num-kv-blocks", type=int, default=None)
    add_memory_flags(launch)
    launch.add_argument("--tls-cert", default=None, help="PEM certificate for every member")
    launch.add_argument("--tls-key", default=None, help="its private key")
    launch.add_argument("--tls-ca", default=None, help="the CA that signed it (mutual TLS)")
    launch.add_argument(
        "--api-key-file", default=None, help="API keys (one per line) for Generate and HTTP"
    )
    launch.set_defaults(func=cmd_launch)

    certs = sub.add_parser("certs", help="a private CA and a member certificate for TLS")
    certs.add_argument("dir", help="an empty directory to write them to")
    certs.add_argument(
        "--host", action="append", required=True, help="an address members are reached at"
    )
    certs.add_argument("--days", type=int, default=365)
    certs.set_defaults(func=cmd_certs)

    add_demo_parser(sub)
    add_drain_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
