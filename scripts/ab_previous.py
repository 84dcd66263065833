"""This tree against an earlier one, in one run: `bench offline` and `bench serve`, A/B
interleaved (A B, then B A, ...), each run a fresh process.

    git archive <rev> | tar -x -C /tmp/previous
    python scripts/ab_previous.py --previous /tmp/previous --rounds 2 --json out/ab.json

Each run happens in its tree's own directory with PYTHONPATH pointing at it, so the other
tree's code is never imported. Reported: per round and in the median over rounds, this
tree's figure divided by the previous tree's (throughput: > 1 is faster; latency: < 1 is
faster). The machine is shared and noisy: read a ratio against the spread of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
OFFLINE = ["bench", "offline", "--batch-sizes", "1,8,32", "--requests-at-batch-1", "4"]
SERVE = ["bench", "serve", "--prefill", "1", "--decode", "1", "--requests", "32"]


def run(tree: Path, argv: list[str], model: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "report.json")
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, "-m", "pdserve.cli", *argv, "--model", model, "--json", str(out)]
        subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        return json.loads(out.read_text())


def figures(kind: str, report: dict) -> dict[str, float]:
    if kind == "offline":
        return {f"offline_b{r['batch_size']}_tok_s": r["pdserve_tok_s"] for r in report["results"]}
    s = report["summary"]
    assert s["errors"] == 0, s["error_examples"]
    return {
        "serve_tok_s": s["throughput_tok_s"],
        "serve_ttft_p50_s": s["ttft_s"]["p50"],
        "serve_tpot_p50_s": s["tpot_s"]["p50"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--previous", type=Path, required=True, help="the earlier tree")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--only", choices=["offline", "serve"], default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    trees = {"previous": args.previous.resolve(), "this": HERE}
    benches = {"offline": OFFLINE, "serve": [*SERVE, "--concurrency", str(args.concurrency)]}
    if args.only:
        benches = {args.only: benches[args.only]}
    rounds = []
    for r in range(args.rounds):
        order = ["previous", "this"] if r % 2 == 0 else ["this", "previous"]
        got: dict[str, dict[str, float]] = {name: {} for name in trees}
        for kind, argv in benches.items():
            for name in order:
                got[name].update(figures(kind, run(trees[name], argv, args.model)))
                print(f"round {r + 1}: {kind} on {name} done", flush=True)
        ratios = {k: got["this"][k] / got["previous"][k] for k in got["this"]}
        rounds.append({"order": order, "figures": got, "ratio_this_over_previous": ratios})
    keys = rounds[0]["ratio_this_over_previous"]
    median = {k: statistics.median(r["ratio_this_over_previous"][k] for r in rounds) for k in keys}
    print(f"{'figure':<22} " + " ".join(f"{'round ' + str(i + 1):>9}" for i in range(len(rounds))))
    for k in keys:
        cells = " ".join(f"{r['ratio_this_over_previous'][k]:>9.3f}" for r in rounds)
        print(f"{k:<22} {cells}   median {median[k]:.3f}")
    print("ratio = this tree / previous tree (tok/s: > 1 faster; seconds: < 1 faster)")
    if args.json:
        report = {
            "benchmark": "ab-previous",
            "model": args.model,
            "previous": str(trees["previous"]),
            "rounds": rounds,
            "median_ratio": median,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
