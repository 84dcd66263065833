"""Re-simulate the points of a `pdserve bench sim-vs-real` report with a profile's terms
changed, next to the report's own simulated figures, each against the same real run: what
a change to a cost term would have done to the comparison, without running anything real
again.

    python scripts/sim_what_if.py REPORT.json --profile PROFILE.json \\
        --set engine.prefill_step=0 [--set handoff.reserve_s=0.003 ...] [--kind cluster]

Terms: `engine.TERM` (the in-process engine's fitted step, read by engine points),
`cluster.TERM` and `cluster_prefill.TERM` (a 1P1D cluster's decode steps and prefill
batches), `handoff.FIELD` and `link.FIELD` (the calls between a cluster's processes and the
KV push), read by cluster points. Each point is simulated with the report's own factors
(an engine point's `engine_factor`, a cluster point's launched cluster's probe, when the
report was made with --rescale) and its own requests (the workload, seed and load of the
report), first as given (which reproduces the report's figures when the profile is the one
it used), then with the changes. Prints sim / real per figure and the misses of each.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: E402

import json  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402

from pdserve.engine.args import EngineArgs  # noqa: E402
from pdserve.sim.cost import FEATURES  # noqa: E402
from pdserve.sim.profile import Profile, load_profile  # noqa: E402
from pdserve.sim.run import Setup, Topology, policy_args, simulate  # noqa: E402
from pdserve.sim.vs_real import TIMING, Comparison, compare  # noqa: E402
from pdserve.weights import model_config  # noqa: E402

FITTED = ("engine", "cluster", "cluster_prefill")  # coefficients by feature
MEASURED = ("handoff", "link")  # fields of a dataclass
SECTIONS = FITTED + MEASURED


def changed(profile: Profile, sets: list[str]) -> Profile:
    """`profile` with each SECTION.TERM=VALUE of `sets` applied (ValueError naming a bad
    one)."""
    for item in sets:
        key, eq, value = item.partition("=")
        section, dot, term = key.partition(".")
        if not (eq and dot) or section not in SECTIONS:
            raise ValueError(f"--set {item!r}: expected {'|'.join(SECTIONS)}.TERM=VALUE")
        current = getattr(profile, section)
        known = ("intercept", *FEATURES) if section in FITTED else dataclasses.asdict(current)
        if term not in known:
            raise ValueError(f"--set {item!r}: unknown term {term!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--set {item!r}: {value!r} is not a number") from None
        if number < 0:
            raise ValueError(f"--set {item!r}: a cost term is at least 0")
        if section in FITTED:
            new = {**current, term: number}
        else:
            new = dataclasses.replace(current, **{term: number})
        profile = dataclasses.replace(profile, **{section: new})
    return profile


def _decode_workers(report: dict) -> int:
    """The launched cluster's decode workers ("1P2D" -> 2)."""
    match = re.fullmatch(r"1P(\d+)D", report.get("cluster") or "1P1D")
    if match is None:
        raise ValueError(f"report: cluster: expected 1PnD, got {report['cluster']!r}")
    return int(match.group(1))


def _point_profile(report: dict, point: dict, profile: Profile, decodes: int) -> Profile:
    """`profile` as the report simulated `point` with it: under --rescale at the point's own
    factors (the factors are recorded without it too)."""
    if not report.get("rescaled"):
        return profile
    if point["kind"] == "engine":
        factor = point.get("engine_factor")
        return profile if factor is None else profile.engine_scaled(factor)
    drift = next((d for d in report.get("cluster_drift", ()) if d["policy"] == point["policy"]), {})
    if "factors" not in drift:
        raise ValueError(
            f"report: {point['policy']}'s cluster has no probe factors (cluster_drift), so its "
            "points cannot be simulated as the report did under --rescale"
        )
    return profile.cluster_scaled(decodes, **drift["factors"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    ap.add_argument("--profile", required=True, help="the profile the report was made with")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.TERM=VALUE")
    ap.add_argument("--kind", choices=("engine", "cluster"), help="only these points")
    args = ap.parse_args()
    with open(args.report) as f:
        report = json.load(f)
    given = load_profile(args.profile)
    try:
        what_if = changed(given, args.set)
    except ValueError as e:
        ap.error(str(e))
    config = model_config(report["model"])
    w = report["workload"]
    blocks = report["pool"]["num_kv_blocks"]
    totals = {"as given": 0, "changed": 0}
    decodes = _decode_workers(report)
    # a 1PnD's decode steps are its cluster_decodes coefficients where measured, not `cluster`
    measured_apart = given.cluster_decode(decodes) is not given.cluster
    if measured_apart and any(item.startswith("cluster.") for item in args.set):
        ap.error(
            f"--set cluster.*: this 1P{decodes}D report's decode steps are the profile's "
            "cluster_decodes, not its 1P1D `cluster` coefficients"
        )
    with tempfile.TemporaryDirectory(prefix="pdserve-whatif-") as spill:
        # as bench sim-vs-real runs them: the engine without prefix caching, clusters with
        bases = {
            "engine": EngineArgs(
                num_kv_blocks=blocks, spill_dir=spill, enable_prefix_caching=False
            ),
            "cluster": EngineArgs(num_kv_blocks=blocks, spill_dir=spill),
        }
        topologies = {"engine": Topology(), "cluster": Topology(prefill=1, decode=decodes)}
        print(f"sim / real: {' '.join(TIMING)}; changed: {', '.join(args.set) or 'nothing'}")
        for p in report["points"]:
            if args.kind is not None and p["kind"] != args.kind:
                continue
            requests = p["real"]["requests"]  # a cluster's: its per-request records
            cmp = Comparison(
                report["model"], given, (), (), blocks,
                requests if isinstance(requests, int) else len(requests),
                w["mean_output"], w["max_output"], report.get("seed", 0), spill,
            )  # fmt: skip
            specs = cmp.specs(p["concurrency"])
            _, engine_args = policy_args(bases[p["kind"]], p["policy"])
            cells = []
            for name, profile in (("as given", given), ("changed", what_if)):
                profile = _point_profile(report, p, profile, decodes)
                setup = Setup(config, profile, topologies[p["kind"]], engine_args, seed=cmp.seed)
                sim = simulate(setup, p["policy"], specs, p["concurrency"], label="")
                got = compare(sim, p["real"], counts=True)
                totals[name] += len(got["misses"])
                ratios = " ".join(f"{got['ratio'][f]:.2f}" for f in TIMING)
                cells.append(f"{name} {ratios} ({len(got['misses'])} misses)")
            print(f"{p['kind']:<7} {p['policy']:<17} {p['concurrency']:>3}  " + " | ".join(cells))
    print(
        f"figures outside their bounds: {totals['as given']} as given, {totals['changed']} changed"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
