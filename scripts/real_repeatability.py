"""How well the real runs of `pdserve bench sim-vs-real` agree with themselves: the real
half of several reports made with the same command (same cluster, pool, workload, policies
and loads), or of one made with `--repeat N` (each point's N real runs), compared with each
other under the same bounds the simulator is held to.

A simulator is deterministic: for a point it predicts one figure. When the real runs of
that point spread wider than a bound, no predicted figure can be inside the bound of every
one of them. Per point and figure this prints the real runs' values and the best coverage
any single prediction can have (the share of the runs within the bound of the best value);
per point, the share of the runs that the best prediction of each figure could match in
every figure at once is at most the smallest of those. It also prints how often one real
run, taken as the prediction, is inside the bounds of another (every ordered pair).

    python scripts/real_repeatability.py REPORT.json [REPORT.json ...] [--kind cluster]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

from pdserve.sim.vs_real import COUNTS, TIMING, best_coverage, bound_of, compare


def setup_key(report: dict, kind: str) -> str:
    """The settings that must match for two reports' real points to be the same points (an
    engine point is the same whatever cluster its report also ran)."""
    keys = ("model", "pool", "workload", "seed") + (("cluster",) if kind == "cluster" else ())
    return json.dumps({k: report.get(k) for k in keys}, sort_keys=True)


def runs_of(name: str, point: dict) -> list[tuple[str, dict]]:
    """A point's real runs as points of their own: the first, and with `bench sim-vs-real
    --repeat` the others (`repeats`), each with the misses of the point's simulated figures
    against it."""
    runs = [(name, point)]
    for k, real in enumerate(point.get("repeats") or (), start=2):
        misses = compare(point["sim"], real, counts=True)["misses"]
        runs.append((f"{name} (run {k})", {**point, "real": real, "misses": misses}))
    return runs


def analyse(reports: list[tuple[str, dict]], kind: str) -> list[dict]:
    by_point: dict[tuple, list[tuple[str, dict]]] = {}
    for name, report in reports:
        for point in report["points"]:
            if point["kind"] != kind:
                continue
            for run, p in runs_of(name, point):
                n = p["real"].get("num_requests")
                key = (setup_key(report, kind), p["policy"], p["concurrency"], n)
                by_point.setdefault(key, []).append((run, p))
    figures = TIMING + COUNTS  # as compare() checks every point
    rows = []
    for (setup, policy, conc, requests), runs in by_point.items():
        if len(runs) < 2:
            continue
        reals = [p["real"] for _, p in runs]
        per_figure = {}
        for figure in figures:
            values = [float(r.get(figure, 0.0)) for r in reals]
            value, share = best_coverage(values, bound_of(figure))
            sims = [float(p["sim"].get(figure, 0.0)) for _, p in runs]
            missed = [
                sim
                for sim, (_, p) in zip(sims, runs)
                if any(m.startswith(f"{figure}:") for m in p["misses"])
            ]
            per_figure[figure] = {
                "values": values,
                "best": value,
                "coverage": share,
                "sims": sims,
                # a simulated figure that missed its own run's yet lies inside the real
                # runs' spread (between their smallest and largest)
                "missed_inside_real_range": sum(min(values) <= x <= max(values) for x in missed),
                "missed": len(missed),
            }
        pairs = [
            not compare(a, b, counts=True)["misses"] for a, b in itertools.permutations(reals, 2)
        ]
        sim_hits = sum(not p["misses"] for _, p in runs)
        rows.append(
            {
                "setup": json.loads(setup),
                "policy": policy,
                "concurrency": conc,
                "requests": requests,
                "runs": [name for name, _ in runs],
                "figures": per_figure,
                "joint_coverage_at_most": min(f["coverage"] for f in per_figure.values()),
                "pairs_within": sum(pairs) / len(pairs),
                "sim_within": sim_hits / len(runs),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--kind", default="cluster", choices=("cluster", "engine"))
    ap.add_argument("--json")
    args = ap.parse_args()
    reports = []
    for path in dict.fromkeys(args.reports):  # a file named twice is one run
        with open(path) as f:
            reports.append((path, json.load(f)))
    rows = analyse(reports, args.kind)
    if not rows:
        sys.exit("no point was run more than once with the same settings")
    short = {
        "throughput_tok_s": "tok/s",
        "ttft_p50_s": "TTFT50",
        "tpot_p50_s": "TPOT50",
        "ttft_p99_s": "TTFT99",
        "tpot_p99_s": "TPOT99",
        "preemptions": "preempt",
        "recomputed_tokens": "recomp",
        "spilled_bytes": "spilled",
    }
    last = None
    for row in rows:
        setup = row["setup"]
        if setup != last:
            print(f"\n{setup.get('cluster') or 'engine'}, {setup['pool']}, {setup['workload']}")
            print("best coverage of one prediction per figure (share of the runs within bound)")
            names = [short[f] for f in row["figures"]]
            print(
                f"{'policy':<17} {'conc':>4} {'runs':>4} "
                + " ".join(f"{n:>7}" for n in names)
                + f" {'joint<=':>7} {'pairs':>6} {'sim':>5}"
            )
            last = setup
        cov = " ".join(f"{f['coverage']:>7.2f}" for f in row["figures"].values())
        print(
            f"{row['policy']:<17} {row['concurrency']:>4} {len(row['runs']):>4} {cov} "
            f"{row['joint_coverage_at_most']:>7.2f} {row['pairs_within']:>6.2f} "
            f"{row['sim_within']:>5.2f}"
        )
    missed = sum(f["missed"] for r in rows for f in r["figures"].values())
    inside = sum(f["missed_inside_real_range"] for r in rows for f in r["figures"].values())
    print(
        f"\nthe simulated figures outside their bounds: {missed}, of which {inside} lie between "
        "the smallest and the largest real run of their point"
    )
    worst = min(rows, key=lambda r: r["joint_coverage_at_most"])
    every = math.prod(r["joint_coverage_at_most"] for r in rows)
    print(
        f"one deterministic prediction inside every bound of a run at every point: at most "
        f"{worst['joint_coverage_at_most']:.2f} of these runs (the worst point, "
        f"{worst['policy']} at {worst['concurrency']}); {every:.3f} if the points were "
        "independent of each other (they are not: a run's points share the machine's "
        "moments). Shares from few runs are estimates, not probabilities"
    )
    if args.json:
        result = {
            "kind": args.kind,
            "points": rows,
            "worst_point_at_most": worst["joint_coverage_at_most"],
            "all_points_if_independent": every,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
