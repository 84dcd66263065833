"""`pdserve sim`: the real scheduler on a virtual clock (pdserve/sim), and
`pdserve sim calibrate`: fit this machine's profile.

pdserve sim --model M [--profile h200|FILE] --policy greedy+recompute,kv-aware+tiered
    --concurrency 1,8,64 [--workload reasoning|azure-conv|...|FILE.jsonl] [--dp N] [--tp K]
    [--dp-attention] [--prefill N --decode M] [--num-kv-blocks N] [--json OUT] [--plot DIR]
pdserve sim calibrate --model M [--cluster] --json PROFILE.json
"""

from __future__ import annotations

import argparse
import json

from pdserve.cli.common import int_list, model_label, print_report, slo_arg

DEFAULT_POLICIES = "greedy+recompute,kv-aware+tiered"


def setup_from_args(args: argparse.Namespace):
    """The simulator's Setup and Load from the command line (ValueError naming the field)."""
    from pdserve.bench.slo import SLO
    from pdserve.bench.workload import load_jsonl
    from pdserve.engine.args import EngineArgs
    from pdserve.sim.profile import load_profile
    from pdserve.sim.run import Setup, Topology
    from pdserve.sim.sweep import Load
    from pdserve.weights import model_config

    if not args.model:
        raise ValueError("model: --model is required")
    config = model_config(args.model)
    profile = load_profile(args.profile)
    topology = Topology(
        dp=args.dp,
        tp=args.tp,
        prefill=args.prefill,
        decode=args.decode,
        route=args.route,
        dp_attention=args.dp_attention,
    )
    engine_args = EngineArgs(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )
    engine_args.scheduler_config(config)  # max_model_len against the model, now
    if args.workload.endswith(".jsonl"):
        specs = load_jsonl(args.workload)
        load = Load(specs=tuple(specs), source=args.workload)
    else:
        load = Load(
            kind=args.workload,
            requests_per_client=args.requests_per_client,
            min_requests=args.min_requests,
            mean_output=args.mean_output,
            max_output=args.max_output,
            native=args.lengths == "native",
        )
    weight_bytes = {"bf16": 2, "fp8": 1}[args.weight_dtype]
    if args.skew and topology.decode < 2:
        raise ValueError(f"skew: {args.skew} needs --prefill and --decode 2 or more")
    setup = Setup(
        config,
        profile,
        topology,
        engine_args,
        weight_bytes,
        args.slo or SLO(),
        args.seed,
        skew=args.skew,
        turn_s=args.turn_s,
        max_tokens=args.max_tokens,
    )
    setup.num_blocks()  # weights that leave no room for KV: say so before anything runs
    return setup, load


def cmd_sim(args: argparse.Namespace) -> int:
    from pdserve.bench.sweep import parse_policy
    from pdserve.sim.plots import plot_sim
    from pdserve.sim.sweep import format_table, sim_sweep

    setup, load = setup_from_args(args)
    policies = [p for p in args.policy.split(",") if p]
    for p in policies:
        parse_policy(p)
    concurrency = args.concurrency if args.concurrency else [None]
    if concurrency == [None] and not load.specs:
        raise ValueError("concurrency: give --concurrency, or a workload file with arrival times")
    report = sim_sweep(setup, policies, concurrency, load, label=model_label(args.model))
    print_report(report, format_table, args.json)
    if args.plot:
        for path in plot_sim(report, args.plot):
            print(f"wrote {path}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from pdserve.sim.calibrate import CONTEXTS, DECODE_BATCHES, calibrate
    from pdserve.sim.calibrate_cluster import DECODES, check_decodes

    if args.cluster_decodes is not None and not args.cluster:
        raise ValueError("--cluster-decodes: the clusters --cluster measures; give --cluster")
    decodes = tuple(args.cluster_decodes or DECODES)
    check_decodes(decodes)  # before the minutes the engine takes
    steps: list[dict] | None = [] if args.samples else None
    profile = calibrate(
        args.model,
        num_kv_blocks=args.num_kv_blocks,
        threads=args.threads,
        samples_out=steps,
        batches=args.batches or DECODE_BATCHES,
        contexts=args.contexts or CONTEXTS,
    )
    if args.samples:
        with open(args.samples, "w") as f:
            json.dump({"model": args.model, "profile": profile["name"], "steps": steps}, f)
    if args.cluster:
        from pdserve.sim.calibrate_cluster import calibrate_cluster

        extra = calibrate_cluster(
            args.model,
            num_kv_blocks=args.cluster_kv_blocks,
            decodes=decodes,
        )
        profile["fit"].update(extra.pop("fit"))
        profile.update(extra)
        profile["sources"].update(
            cluster="measured: the traces of a launched 1P1D cluster on this machine, fitted",
            cluster_decodes="measured: the decode steps of launched 1PnD clusters "
            f"(n = {', '.join(extra['cluster_decodes']) or 'none'}; CPU nodes only)",
            link="measured: the push tails of that cluster against the bytes pushed",
            handoff="measured: medians of that cluster's reserve, prefill RPC and start spans",
        )
    with open(args.json, "w") as f:
        json.dump(profile, f, indent=1)

    def table(p: dict) -> str:
        lines = [f"profile {p['name']} ({p['kind']}, KV {p['dtype']})"]
        for part, fit in p.get("fit", {}).items():
            lines.append(
                f"  {part}: {fit['steps']} steps, median error {fit['median_abs_rel_error']:.1%},"
                f" p90 {fit['p90_abs_rel_error']:.1%}"
            )
        for tier, t in p["tiers"].items():
            lines.append(
                f"  {tier}: spill {t['spill_bytes_s'] / 1e9:.2f} GB/s, reload "
                f"{t['reload_bytes_s'] / 1e9:.2f} GB/s"
            )
        return "\n".join(lines)

    print(table(profile))
    print(f"wrote {args.json}")
    return 0


def add_sim_parser(sub) -> None:
    from prefill.config import PrefillConfig

    sim = sub.add_parser("sim", help="the real scheduler on a virtual clock (SIMULATED figures)")
    sim.add_argument("--model", default=None, help="preset, checkpoint dir or config.json")
    sim.add_argument("--profile", default="h200", help="h100 | h200 | a profile JSON file")
    sim.add_argument("--policy", default=DEFAULT_POLICIES, help="admission+preemption, ...")
    sim.add_argument("--concurrency", type=int_list, default=None, help="closed-loop clients")
    sim.add_argument(
        "--workload",
        default="reasoning",
        help="reasoning | azure-conv | azure-code | mooncake-conv | uniform | FILE.jsonl",
    )
    sim.add_argument(
        "--lengths",
        default="native",
        choices=["native", "cpu"],
        help="trace workloads: lengths as recorded (native) or scaled as bench sweep does (cpu)",
    )
    sim.add_argument("--requests-per-client", type=int, default=2)
    sim.add_argument("--min-requests", type=int, default=8)
    sim.add_argument("--mean-output", type=int, default=128)
    sim.add_argument("--max-output", type=int, default=None)
    sim.add_argument("--dp", type=int, default=1, help="colocated replicas")
    sim.add_argument("--tp", type=int, default=1, help="GPUs per replica (tensor parallel)")
    sim.add_argument(
        "--dp-attention",
        action="store_true",
        help="each replica's TP ranks attend data-parallel, each for its own requests with "
        "their whole KV (how MLA models are served; colocated, --tp 2 or more)",
    )
    sim.add_argument("--prefill", type=int, default=0, help="disaggregated: prefill workers")
    sim.add_argument("--decode", type=int, default=0, help="disaggregated: decode workers")
    sim.add_argument("--route", default="headroom", choices=["headroom", "round-robin"])
    sim.add_argument(
        "--skew",
        default=None,
        choices=("late-join", "scale-out"),
        help="disaggregated, 2+ decode workers: all but one join after half the requests "
        "arrived (late-join) or once the first wave, one request per client, started "
        "(scale-out: closed loop); a +migrate policy moves requests to them",
    )
    sim.add_argument("--num-kv-blocks", type=int, default=None, help="default: what fits")
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument("--no-prefix-caching", action="store_true")
    sim.add_argument("--max-num-seqs", type=int, default=256)
    sim.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sim.add_argument(
        "--turn-s",
        type=float,
        default=PrefillConfig.turn_s,
        help="with a profile whose cluster shares the CPUs: a prefill batch's turn, as "
        "`serve prefill --turn-s` (0: batches by tokens alone)",
    )
    sim.add_argument("--max-model-len", type=int, default=None)
    sim.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="every request's max_tokens, as a client's cap; each still generates its "
        "workload length, ended by a stop token the scheduler does not see coming (as EOS). "
        "Default: max_tokens = the request's length, as the benchmarks send it, which tells a "
        "policy that reads max_tokens every request's exact length",
    )
    sim.add_argument("--weight-dtype", default="bf16", choices=["bf16", "fp8"])
    sim.add_argument("--slo", type=slo_arg, default=None, help="ttft=SECONDS,tpot=SECONDS")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--json", default=None)
    sim.add_argument("--plot", default=None, help="directory for the PNG plots")
    sim.set_defaults(func=cmd_sim)
    actions = sim.add_subparsers(dest="sim_action")
    cal = actions.add_parser("calibrate", help="measure this machine and fit a profile")
    cal.add_argument("--model", required=True)
    cal.add_argument("--num-kv-blocks", type=int, default=2400)
    cal.add_argument("--threads", type=int, default=None)
    cal.add_argument("--cluster", action="store_true", help="also measure a launched 1P1D cluster")
    cal.add_argument("--cluster-kv-blocks", type=int, default=256)
    cal.add_argument(
        "--cluster-decodes",
        type=int_list,
        default=None,
        help="decode workers of the clusters measured (default 1,2: 1P1D and 1P2D, where "
        "they split the CPUs and a step costs more; CPU nodes only)",
    )
    cal.add_argument("--json", required=True, help="write the profile here")
    cal.add_argument("--samples", default=None, help="also write every measured step here")
    cal.add_argument(
        "--batches", type=int_list, default=None, help="clients per grid point (1,2,4,8,16,32)"
    )
    cal.add_argument(
        "--contexts", type=int_list, default=None, help="prompt tokens (32,128,512,1024)"
    )
    cal.set_defaults(func=cmd_calibrate)
