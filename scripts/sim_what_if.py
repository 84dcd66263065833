"""Re-simulate the engine points of a `pdserve bench sim-vs-real` report with a profile's
fitted coefficients changed, next to the report's own simulated figures, each against the
same real run: what a change to a cost term would have done to the comparison, without
running anything real again.

    python scripts/sim_what_if.py REPORT.json --profile PROFILE.json \\
        --set engine.prefill_step=0 [--set engine.intercept=0.03 ...]

Each engine point is simulated with the report's own factor (`engine_factor`, from its
probes, when the report was made with --rescale) and its own requests (the workload, seed
and load of the report), first as given (which reproduces the report's figures when the
profile is the one it used), then with the changes. Prints sim / real per figure and the
misses of each.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: E402

import json  # noqa: E402
import tempfile  # noqa: E402

from pdserve.engine.args import EngineArgs  # noqa: E402
from pdserve.sim.cost import FEATURES  # noqa: E402
from pdserve.sim.profile import Profile, load_profile  # noqa: E402
from pdserve.sim.run import Setup, Topology, policy_args, simulate  # noqa: E402
from pdserve.sim.vs_real import TIMING, Comparison, compare  # noqa: E402
from pdserve.weights import model_config  # noqa: E402

SECTIONS = ("engine",)  # the fitted coefficients an engine point's simulation reads


def changed(profile: Profile, sets: list[str]) -> Profile:
    """`profile` with each SECTION.TERM=VALUE of `sets` applied (ValueError naming a bad
    one)."""
    for item in sets:
        key, eq, value = item.partition("=")
        section, dot, term = key.partition(".")
        if not (eq and dot) or section not in SECTIONS:
            raise ValueError(f"--set {item!r}: expected {'|'.join(SECTIONS)}.TERM=VALUE")
        if term not in ("intercept", *FEATURES):
            raise ValueError(f"--set {item!r}: unknown term {term!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--set {item!r}: {value!r} is not a number") from None
        if number < 0:
            raise ValueError(f"--set {item!r}: a cost term is at least 0")
        coefficients = dict(getattr(profile, section))
        coefficients[term] = number
        profile = dataclasses.replace(profile, **{section: coefficients})
    return profile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    ap.add_argument("--profile", required=True, help="the profile the report was made with")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.TERM=VALUE")
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
    with tempfile.TemporaryDirectory(prefix="pdserve-whatif-") as spill:
        base = EngineArgs(num_kv_blocks=blocks, spill_dir=spill, enable_prefix_caching=False)
        print(f"sim / real: {' '.join(TIMING)}; changed: {', '.join(args.set) or 'nothing'}")
        for p in report["points"]:
            if p["kind"] != "engine":
                continue
            cmp = Comparison(
                report["model"], given, (), (), blocks, p["real"]["requests"],
                w["mean_output"], w["max_output"], report.get("seed", 0), spill,
            )  # fmt: skip
            specs = cmp.specs(p["concurrency"])
            _, engine_args = policy_args(base, p["policy"])
            cells = []
            for name, profile in (("as given", given), ("changed", what_if)):
                # --rescale: simulated at the probes' factor (recorded without it too)
                if report.get("rescaled") and p.get("engine_factor") is not None:
                    profile = profile.engine_scaled(p["engine_factor"])
                setup = Setup(config, profile, Topology(), engine_args, seed=cmp.seed)
                sim = simulate(setup, p["policy"], specs, p["concurrency"], label="")
                got = compare(sim, p["real"], counts=True)
                totals[name] += len(got["misses"])
                ratios = " ".join(f"{got['ratio'][f]:.2f}" for f in TIMING)
                cells.append(f"{name} {ratios} ({len(got['misses'])} misses)")
            print(f"{p['policy']:<17} {p['concurrency']:>3}  " + " | ".join(cells))
    print(
        f"figures outside their bounds: {totals['as given']} as given, {totals['changed']} changed"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
