"""The CPU paged decode kernel (kernels/csrc/paged_decode_cpu.c) of this tree against an
earlier tree's, in one run, interleaved (A B, then B A, ...), each pass in a fresh process
with its tree on PYTHONPATH, so that each builds and loads its own kernel.

    git archive <rev> | tar -x -C /tmp/previous
    python scripts/paged_decode_ab.py --previous /tmp/previous [--rounds 2] [--json out.json]

Each point is one decode step's attention over `--layers` layers' pools (SmolLM2-135M's
shape by default: 9 query heads, 3 KV heads of 64, 16-token blocks), larger together than
the caches, with each sequence's blocks either in order in the pool (as a fresh pool
hands them out) or shuffled across it (as a pool after churn does). Reported per point:
ms per layer and the KV read rate (bytes of keys and values over the time), per tree, and
this tree's speed-up (> 1: faster). The machine is noisy: read a ratio against the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
POINTS = ((8, 2048), (32, 512), (32, 2048))
ORDERS = ("shuffled", "ordered")


def measure(points, layers: int, reps: int, heads: tuple[int, int, int], block_size: int) -> list:
    """In this process (whose tree is on sys.path): ms per layer at each point."""
    import time

    import torch

    from kernels.paged_decode_cpu import paged_gqa_decode_cpu

    hq, hkv, dim = heads
    out = []
    for batch, ctx in points:
        nb = -(-ctx // block_size)
        for order in ORDERS:
            gen = torch.Generator().manual_seed(batch * 7919 + ctx)
            pools = [
                torch.randn(2, batch * nb + 1, block_size, hkv, dim, generator=gen)
                for _ in range(layers)
            ]
            ids = (
                torch.arange(batch * nb)
                if order == "ordered"
                else torch.randperm(batch * nb, generator=gen)
            )
            table = (ids + 1).view(batch, nb).to(torch.int32)
            lens = torch.full((batch,), ctx, dtype=torch.int32)
            q = torch.randn(batch, hq, dim, generator=gen)
            times = []
            for _ in range(reps + 1):  # the first pass is a warm-up (and builds the kernel)
                start = time.perf_counter()
                for pool in pools:
                    paged_gqa_decode_cpu(q, pool[0], pool[1], table, lens, dim**-0.5)
                times.append((time.perf_counter() - start) / layers)
            ms = statistics.median(times[1:]) * 1e3
            kv_bytes = batch * ctx * hkv * dim * 4 * 2
            out.append(
                {"batch": batch, "context": ctx, "order": order, "ms_per_layer": ms,
                 "kv_gb_s": kv_bytes / ms / 1e6}
            )  # fmt: skip
    return out


def run_tree(tree: Path, args) -> list:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", "--layers",
           str(args.layers), "--reps", str(args.reps), "--threads", str(args.threads)]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode:
        raise SystemExit(f"{tree}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--previous", type=Path, help="the earlier tree (a directory)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(measure(POINTS, args.layers, args.reps, (9, 3, 64), 16)))
        return
    if args.previous is None or not (args.previous / "kernels" / "csrc").is_dir():
        raise SystemExit("--previous: a directory holding an earlier tree (kernels/csrc/)")
    trees = {"this": HERE, "previous": args.previous.resolve()}
    runs: dict[str, list] = {"this": [], "previous": []}
    for r in range(args.rounds):
        for name in ("this", "previous") if r % 2 == 0 else ("previous", "this"):
            runs[name].append(run_tree(trees[name], args))
            print(f"round {r + 1}: {name} done", file=sys.stderr, flush=True)
    rows = []
    for i, point in enumerate(runs["this"][0]):
        this = [run[i]["ms_per_layer"] for run in runs["this"]]
        prev = [run[i]["ms_per_layer"] for run in runs["previous"]]
        ratios = [p / t for t, p in zip(this, prev)]
        rows.append(
            {"batch": point["batch"], "context": point["context"], "order": point["order"],
             "this_ms": this, "previous_ms": prev,
             "this_kv_gb_s": [run[i]["kv_gb_s"] for run in runs["this"]],
             "previous_kv_gb_s": [run[i]["kv_gb_s"] for run in runs["previous"]],
             "speedup": ratios, "speedup_median": statistics.median(ratios)}
        )  # fmt: skip
        this_rate = statistics.median(rows[-1]["this_kv_gb_s"])
        prev_rate = statistics.median(rows[-1]["previous_kv_gb_s"])
        print(
            f"batch {point['batch']:3d} context {point['context']:5d} {point['order']:9s} "
            f"this {statistics.median(this):6.2f} ms/layer ({this_rate:5.1f} GB/s), previous "
            f"{statistics.median(prev):6.2f} ({prev_rate:5.1f} GB/s): "
            f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})"
        )
    if args.json:
        from pdserve.bench.report import machine_info

        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"benchmark": "paged_decode_ab", "machine": machine_info(), "rows": rows,
                  "rounds": args.rounds, "layers": args.layers, "reps": args.reps}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
