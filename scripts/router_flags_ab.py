"""Two launched 1P1D clusters that differ only in their router's flags, driven in interleaved
rounds through the OpenAI API by the same client (pdserve.bench.openai_load): throughput,
TTFT and TPOT per point, each process's CPU while its side ran, and the per-round ratio.

    .venv/bin/python scripts/router_flags_ab.py --b-flags="--no-token-feed --no-http-in-process" \\
        --concurrency 16,32 --rounds 3 --json out/ab.json

Side `a` runs the router's defaults plus --a-flags, side `b` plus --b-flags; both compute
prompts of up to --local-prefill-tokens on the decode worker (0: on the prefill worker).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_side_by_side import get_json, tree_cpu_seconds  # noqa: E402

from pdserve.bench.openai_load import point_row, prompt_texts, run_point  # noqa: E402
from pdserve.bench.report import machine_info, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--a-flags", default="", help="router flags of side a")
    ap.add_argument("--b-flags", default="", help="router flags of side b")
    ap.add_argument("--concurrency", default="16,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--local-prefill-tokens", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    flags = {"a": shlex.split(args.a_flags), "b": shlex.split(args.b_flags)}

    from pdserve.launch import Cluster

    points = []
    with contextlib.ExitStack() as stack:
        clusters = {
            side: stack.enter_context(
                Cluster(
                    args.model,
                    1,
                    1,
                    http_port=0,
                    decode_args=["--num-kv-blocks", str(args.num_kv_blocks)],
                    local_prefill_tokens=args.local_prefill_tokens,
                    router_args=router_flags,
                )
            )
            for side, router_flags in flags.items()
        }
        urls = {side: f"http://{c.http_address}" for side, c in clusters.items()}
        names = {side: get_json(f"{u}/v1/models")["data"][0]["id"] for side, u in urls.items()}
        for side, url in urls.items():  # warm-up
            run_point(url, names[side], 2, prompt_texts(2, -1), 8, "chat")
        for r in range(args.rounds):
            for c in concurrencies:
                texts = prompt_texts(2 * c, 1000 * r + c)
                for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                    procs = clusters[side].procs  # router, prefill, decode
                    before = [tree_cpu_seconds(p.pid) for p in procs]
                    desc = f"round {r} c={c} {side}"
                    point = run_point(
                        urls[side], names[side], c, texts, args.max_tokens, "chat", desc=desc
                    )
                    cpu = [
                        (tree_cpu_seconds(p.pid) - b) / point["elapsed_s"]
                        for p, b in zip(procs, before)
                    ]
                    point.pop("records", None)
                    point.update(side=side, round=r, cpu_cores=cpu)
                    points.append(point)
                    print(point_row(side, point), "cores", [round(x, 3) for x in cpu], flush=True)
    summary = {}
    for c in concurrencies:
        of = {
            side: [p for p in points if p["side"] == side and p["concurrency"] == c]
            for side in flags
        }
        tput = {side: [p["throughput_tok_s"] for p in ps] for side, ps in of.items()}
        summary[str(c)] = {
            "a_over_b_per_round": [a / b for a, b in zip(tput["a"], tput["b"])],
            **{
                side: {
                    "throughput_median": statistics.median(tput[side]),
                    "tpot_p50_median_s": statistics.median(p["tpot_s"]["p50"] for p in ps),
                    "router_cores_median": statistics.median(p["cpu_cores"][0] for p in ps),
                    "decode_cores_median": statistics.median(p["cpu_cores"][-1] for p in ps),
                }
                for side, ps in of.items()
            },
        }
        s = summary[str(c)]
        print(
            f"c={c}: a/b per round {[round(x, 3) for x in s['a_over_b_per_round']]}; "
            f"a {s['a']['throughput_median']:.1f} tok/s, b {s['b']['throughput_median']:.1f}"
        )
    if args.json:
        write_json(
            {
                "benchmark": "router-flags-ab",
                "model": args.model,
                "flags": flags,
                "max_tokens": args.max_tokens,
                "local_prefill_tokens": args.local_prefill_tokens,
                "machine": machine_info(),
                "summary": summary,
                "points": points,
            },
            args.json,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
