"""`pdserve plan`: the best serving layouts for a model on N GPUs of one kind, searched in
the simulator (pdserve/sim/plan.py); every figure is SIMULATED.

pdserve plan --model CONFIG --gpu h200 --gpus 8 --workload azure-conv --slo ttft=2,tpot=0.05
    [--concurrency 256] [--requests 800] [--json OUT]
"""

from __future__ import annotations

import argparse

from pdserve.cli.common import model_label, print_report, slo_arg


def cmd_plan(args: argparse.Namespace) -> int:
    from pdserve.bench.slo import SLO
    from pdserve.bench.workload import load_jsonl
    from pdserve.engine.args import EngineArgs
    from pdserve.sim.plan import format_plan, plan
    from pdserve.sim.profile import load_profile
    from pdserve.sim.sweep import Load
    from pdserve.weights import model_config

    config = model_config(args.model)
    profile = load_profile(args.gpu)
    if args.workload.endswith(".jsonl"):
        specs = load_jsonl(args.workload)
        concurrency = args.concurrency  # None: the file's arrival times (open loop)
    else:
        load = Load(kind=args.workload, min_requests=args.requests, mean_output=args.mean_output)
        concurrency = args.concurrency or 256
        specs = load.for_point(None, args.seed)[: args.requests]
    engine_args = EngineArgs(block_size=args.block_size, max_model_len=args.max_model_len)
    engine_args.scheduler_config(config)
    weight_bytes = {"bf16": 2, "fp8": 1}[args.weight_dtype]
    report = plan(
        config,
        profile,
        args.gpus,
        specs,
        concurrency,
        args.slo or SLO(),
        engine_args,
        weight_bytes,
        sample=args.sample,
        seed=args.seed,
        label=model_label(args.model),
    )
    return print_report(report, format_plan, args.json)


def add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="search DP/TP (and DP attention) and P:D layouts in the simulator (SIMULATED)"
    )
    p.add_argument("--model", required=True, help="preset, checkpoint dir or config.json")
    p.add_argument("--gpu", default="h200", help="h100 | h200 | a profile JSON file")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument(
        "--workload",
        default="azure-conv",
        help="azure-conv | azure-code | mooncake-conv | reasoning | uniform | FILE.jsonl",
    )
    p.add_argument("--concurrency", type=int, default=None, help="closed-loop clients")
    p.add_argument("--requests", type=int, default=800, help="requests the winner is confirmed on")
    p.add_argument("--sample", type=int, default=400, help="requests each candidate runs")
    p.add_argument("--mean-output", type=int, default=128, help="the reasoning workload's mean")
    p.add_argument("--slo", type=slo_arg, default=None, help="ttft=SECONDS,tpot=SECONDS")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--weight-dtype", default="bf16", choices=["bf16", "fp8"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_plan)
