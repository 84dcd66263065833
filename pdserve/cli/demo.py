"""`pdserve demo`: SmolLM2 answers a question, then the capacity-trap sweep."""

from __future__ import annotations

import argparse

from pdserve.cli.common import DEMO_MODEL

DEMO_KV_BLOCKS = 32  # 512 tokens: the longest long-prompt request (320 + 192) just fits
DEMO_MAX_OUTPUT = 192
DEMO_CONCURRENCY = (1, 4, 24)
DEMO_WORKLOAD = "long-prompt"  # contexts where a recompute costs several decode steps here
DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
)


def cmd_demo(args: argparse.Namespace) -> int:
    """The capacity trap on a laptop-sized budget: a 1P2D SmolLM2 cluster whose decode workers
    hold only DEMO_KV_BLOCKS blocks each, swept over concurrency with today's policy
    (greedy admission, recompute preemption: vLLM's behaviour) and our default (what a decode
    worker runs given no flags: cost-aware admission over the spill tiers). Prompts of
    192-320 tokens: on 2 CPU cores recomputing such a context costs ~4 decode steps
    (`bench preempt-cost`), so the baseline's preemptions cost what they cost on a GPU."""
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
        f"of 16 tokens per decode worker, {DEMO_WORKLOAD} workload (192-320-token prompts, "
        f"long-tailed outputs of mean 64 up to {DEMO_MAX_OUTPUT}), closed-loop clients at "
        f"concurrency {','.join(map(str, DEMO_CONCURRENCY))}, two requests each; "
        f"greedy+recompute (today's engines) against our default, both clusters up at once "
        f"(~1 min to start on 2 cores) and the policies interleaved at each point; about 10 "
        f"minutes"
    )
    report = bench_sweep(
        DEMO_MODEL,
        ["greedy+recompute", "default"],
        list(DEMO_CONCURRENCY),
        prefill=1,
        decode=2,
        num_kv_blocks=DEMO_KV_BLOCKS,
        requests_per_client=2,
        min_requests=4,
        mean_output=64,
        max_output=DEMO_MAX_OUTPUT,
        workload=DEMO_WORKLOAD,
        partial_json=args.json,
    )
    print(format_table(report))
    write_json(report, args.json)
    print(f"wrote {args.json}")
    for path in plot_sweep(report, args.plot):
        print(f"wrote {path}")
    print("what the plots show: docs/capacity-trap.md")
    return 0


def add_demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="SmolLM2 answers, then the capacity-trap sweep")
    demo.add_argument("--json", default="out/demo-sweep.json")
    demo.add_argument("--plot", default="out/demo-plots")
    demo.set_defaults(func=cmd_demo)
