"""`pdserve bench sim-vs-real`: the simulator against the real runs it imitates, in one run.

For each policy and concurrency, on the same workload (closed-loop clients, the reasoning
workload's long-tailed outputs, requests run to their length) and the same pool:

    engine    the real in-process engine (LLM's core) driven on the wall clock, against the
              simulator's replica of it (the same scheduler, allocator and policies) with
              the calibrated profile's engine cost model
    cluster   a real launched cluster (`pdserve launch`: router, prefill and decode worker
              processes over NIXL), against the simulator's disaggregated topology with the
              profile's cluster costs (--cluster)

Per point: the simulated figure over the real one (throughput, TTFT and TPOT p50/p99,
preemptions, recomputed tokens, spilled bytes), and whether it is inside the targets
(throughput and p50s within 15%, p99s within 30%; for clusters, preemptions and recomputed
tokens within 20%). A miss says which figure and by how much.

With `--repeat N` each point's real half runs N times (the loads in turn, N rounds, on the
same engine or cluster; each load and round with prompts of its own tokens, the lengths the
same, so that none hits a cached prefix of another): the first round is the comparison (the
issue's "one run"), and every point also reports the real runs' range per figure (`spread`)
and each miss says why: the real runs' disagreement (no single figure is within the bound
of every run, and the simulated one is within it of as many as any figure could be), or the
model's error (a figure within the bound of more of the runs existed). An engine
point is simulated at its first round's speed (the probes' factor then); its later rounds
ran minutes later, so on a drifting machine its spread includes the drift.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass
from types import MappingProxyType

from pdserve.bench.report import machine_info
from pdserve.bench.slo import SLO
from pdserve.bench.workload import RequestSpec, prompts_for, specs_of
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.engine.cuda_graphs import warm_up_graphs
from pdserve.engine.gate import make_admission
from pdserve.sim.fit import LARGE, SMALL, measured_over
from pdserve.sim.load import summarize
from pdserve.sim.profile import Profile
from pdserve.sim.replica import Replica, run_real
from pdserve.sim.run import Setup, Topology, policy_args, simulate
from pdserve.weights import model_config

POLICIES = ("greedy+recompute", "greedy+tiered", "kv-aware+tiered")
TIMING = ("throughput_tok_s", "ttft_p50_s", "tpot_p50_s", "ttft_p99_s", "tpot_p99_s")
COUNTS = ("preemptions", "recomputed_tokens", "spilled_bytes")
BOUNDS = MappingProxyType({"p50": 0.15, "p99": 0.30, "throughput": 0.15, "counts": 0.20})
DRIFT = 0.10  # a probe's steps further than this from the profile's: calibrate again


def bound_of(figure: str) -> float:
    if figure in COUNTS:
        return BOUNDS["counts"]
    return BOUNDS["p99"] if "p99" in figure else BOUNDS["p50"]


def within(pred: float, real: float, bound: float, eps: float = 0.0) -> bool:
    """Whether `pred` is inside `bound` (+ `eps`) of `real` (0 predicts 0 exactly)."""
    if pred == 0 and real == 0:
        return True
    return real != 0 and abs(pred / real - 1) <= bound + eps


def compare(sim: dict, real: dict, counts: bool) -> dict:
    """sim / real per figure, and the figures outside their bounds."""
    ratios, misses = {}, []
    for figure in TIMING + COUNTS:
        r, s = real.get(figure, 0.0), sim.get(figure, 0.0)
        if r == 0 and s == 0:
            ratios[figure] = 1.0
            continue
        ratio = s / r if r else math.inf
        ratios[figure] = ratio
        checked = figure in TIMING or counts
        if checked and not abs(ratio - 1) <= bound_of(figure):
            misses.append(f"{figure}: sim {s:.4g} vs real {r:.4g} ({ratio:.2f}x)")
    return {"ratio": ratios, "misses": misses}


EPS = 1e-9  # an interval's own ends count as inside it, whatever the rounding


def best_coverage(values: list[float], bound: float) -> tuple[float, float]:
    """(the value a prediction covering the most runs could take, the share it covers).
    A run v is covered by p when |p/v - 1| <= bound, i.e. p in [v(1-b), v(1+b)]; the most
    intervals overlap at one of their left ends (or at 0 when the runs are 0), which are
    the candidates, counted with a hair of tolerance so that an end covers its own run."""
    candidates = {0.0} | {v * (1 - bound) for v in values}

    def covered(p: float) -> int:
        return sum(within(p, v, bound, EPS) for v in values)

    best = max(sorted(candidates), key=covered)
    return best, covered(best) / len(values)


def spread_of(sim: dict, reals: list[dict]) -> dict:
    """Per figure, over the real runs of one point (runs with no value of it, a percentile
    of nothing, left out): their range, how many of them the simulated figure is within its
    bound of (`within`), the most any single figure could be within it of (`best_within`,
    at `best`), and `real_spread`: no single figure is within the bound of every run, and
    the simulated one is within it of as many as any could be; a miss of such a figure is
    the real runs' disagreement, not the model's error."""
    out = {}
    for figure in TIMING + COUNTS:
        values = [float(r.get(figure, 0.0)) for r in reals]
        values = [v for v in values if math.isfinite(v)]
        if not values:
            out[figure] = {"runs": 0, "real_spread": False}
            continue
        bound = bound_of(figure)
        s = float(sim.get(figure, 0.0))
        n = len(values)
        best, share = best_coverage(values, bound)
        best_within = round(share * n)
        hits = sum(within(s, v, bound, EPS) for v in values)
        out[figure] = {
            "min": min(values),
            "max": max(values),
            "runs": n,
            "within": hits,
            "best": best,
            "best_within": best_within,
            "real_spread": best_within < n and hits >= best_within,
        }
    return out


def explained(misses: list[str], spread: dict) -> list[str]:
    """Each miss (against the first real run) with why, from the real runs of its point:
    the real runs' disagreement (no single figure is within the bound of them all, and the
    simulated one is within it of as many as any figure could be), or the model's error (a
    figure within the bound of more runs existed)."""
    out = []
    for miss in misses:
        s = spread[miss.split(":", 1)[0]]
        n = s["runs"]
        if not n:
            out.append(f"{miss}; no real run has this figure")
            continue
        lo, hi, k, best = s["min"], s["max"], s["within"], s["best_within"]
        if s["real_spread"]:
            why = (
                f"the real runs' disagreement: no figure is within the bound of all {n}, "
                f"this one is within it of {k}, as many as any could be"
            )
        else:
            why = (
                f"the model's error: {s['best']:.4g} would be within the bound of {best} of "
                f"the {n} runs, this one is within it of {k}"
            )
        apart = f", {hi / lo:.2f}x apart" if lo > 0 else ""
        out.append(f"{miss}; {why} (runs {lo:.4g}-{hi:.4g}{apart})")
    return out


def with_spread(result: dict, sim: dict, reals: list[dict]) -> dict:
    """compare()'s result for the first run, with the spread of all `reals` when there are
    several, and its misses explained by it (`misses_from_real_spread`: how many are the
    real runs' disagreement)."""
    if len(reals) < 2:
        return result
    spread = spread_of(sim, reals)
    noise = sum(spread[m.split(":", 1)[0]]["real_spread"] for m in result["misses"])
    return {
        **result,
        "spread": spread,
        "misses": explained(result["misses"], spread),
        "misses_from_real_spread": noise,
    }


@dataclass(frozen=True)
class Comparison:
    """What both halves run: the same model, profile, policies, loads and pool."""

    model: str
    profile: Profile
    policies: tuple[str, ...]
    concurrencies: tuple[int, ...]
    num_kv_blocks: int
    requests: int  # at least, per point
    mean_output: int
    max_output: int
    seed: int
    spill_dir: str
    decode_workers: int = 1  # of the launched cluster (1P1D, 1P2D, ...)
    # --rescale: each point simulated with the step costs scaled by the probes (an engine
    # point's factor interpolated in time between the engine's probes on either side of it,
    # a cluster point's from its policy's launched cluster's probe), and with the profile as
    # given too
    rescale: bool = False
    repeat: int = 1  # real runs per point (--repeat); the first is the comparison

    def simulate(self, setup: Setup, policy: str, specs, concurrency: int, label: str):
        """A point -> (simulated with `setup`'s profile, and under --rescale with the
        profile as given too, else None)."""
        sim = simulate(setup, policy, specs, concurrency, label=label)
        if not self.rescale:
            return sim, None
        given = dataclasses.replace(setup, profile=self.profile)
        return sim, simulate(given, policy, specs, concurrency, label="")

    def specs(self, concurrency: int) -> list[RequestSpec]:
        n = max(self.requests, concurrency)
        return specs_of("reasoning", n, self.seed + concurrency, self.mean_output, self.max_output)

    def prompt_seed(self, concurrency: int, round_: int = 0) -> int:
        """The prompts' seed of a load in `round_` of --repeat: each load and round draws
        its own tokens (the lengths are the load's whatever the round), so that none finds
        a prefix an earlier one left cached (a launched cluster caches prefixes; with one
        seed for every load, each load's first prompt began with the previous one's)."""
        return self.seed + 7_919 * concurrency + 104_729 * round_

    def point(self, kind: str, policy: str, concurrency: int, reals: list, sims: tuple) -> dict:
        """`reals`: the point's real runs, the comparison's first (more with --repeat)."""
        sim, raw = sims
        sim.pop("series", None)
        point = {
            "kind": kind,
            "policy": policy,
            "concurrency": concurrency,
            "real": reals[0],
            "sim": sim,
            **with_spread(compare(sim, reals[0], counts=True), sim, reals),
        }
        if len(reals) > 1:
            point["repeats"] = reals[1:]
        if raw is not None:  # --rescale: the profile as given, too
            raw.pop("series", None)
            point["unscaled"] = {
                "sim": raw,
                **with_spread(compare(raw, reals[0], counts=True), raw, reals),
            }
        return point


def engine_drift(cmp: Comparison) -> dict | None:
    """How fast this machine runs now against the profile it is compared with: a short probe
    of the real engine (calibration's own grid at 1 and 8 clients over 128-token prompts,
    ~120 steps) -> the median over its steps of measured / the profile's predicted time.
    A shared machine's speed drifts between sessions (the real engine here ran 1.25-1.4x
    slower on 2026-12-05 than on the day its profile was measured); a profile from a faster
    day makes every simulated figure fast by about this. None for a roofline profile."""
    from pdserve.sim.calibrate import measure_engine

    if cmp.profile.kind != "fitted":
        return None
    args = EngineArgs(num_kv_blocks=128, spill_dir=cmp.spill_dir, enable_prefix_caching=False)
    core, _ = build_engine(cmp.model, args)
    try:
        samples = measure_engine(
            core, batches=(1, 8), contexts=(128,), outputs=12, decode_outputs=32, seed=cmp.seed
        )
    finally:
        core.close()
    return measured_over(samples, cmp.profile.engine)


def engine_points(cmp: Comparison) -> tuple[list[dict], list[dict]]:
    """-> (the engine's points, its probes of the machine). The machine's speed moves within
    a run (on 2026-12-06 the engine slowed from 1.22x to 1.73x the profile's step time over
    15 minutes), so the engine is probed before the first policy's points, between two
    policies (after one's engine is closed, before the next one's is built: one engine at a
    time) and after the last, and each point's factor is interpolated in time between the
    probes on either side of it, at the middle of its run. A point is simulated once the
    probe after it is made."""
    config = model_config(cmp.model)
    base = EngineArgs(
        num_kv_blocks=cmp.num_kv_blocks, spill_dir=cmp.spill_dir, enable_prefix_caching=False
    )
    started = time.monotonic()
    probes: list[dict] = []

    def probe(policy: str | None) -> dict | None:
        """The machine now, before `policy`'s points (None: after the last)."""
        t0 = time.monotonic()
        drift = engine_drift(cmp)
        if drift is None:
            return None
        at = (t0 + time.monotonic()) / 2 - started
        probes.append({"policy": policy, **drift, "at_s": at})
        return probes[-1]

    points = []
    before = probe(cmp.policies[0])
    for i, policy in enumerate(cmp.policies):
        admission, args = policy_args(base, policy)
        core, _ = build_engine(cmp.model, args)
        warm = [RequestSpec(0.0, 8, 2)]  # first forward passes are slow; calibrate skips them too
        run_real(
            Replica("warm-up", core), warm, prompts_for(warm, config.vocab_size, 0), 1, label=""
        )
        # on CUDA: the decode graphs captured before the timed runs (not in their first steps)
        warm_up_graphs(core, max(cmp.concurrencies), cmp.num_kv_blocks)
        runs: dict[int, list[tuple[dict, float]]] = {c: [] for c in cmp.concurrencies}
        for round_ in range(cmp.repeat):
            for c in cmp.concurrencies:
                specs = cmp.specs(c)
                prompts = prompts_for(specs, config.vocab_size, cmp.prompt_seed(c, round_))
                before_stats, t0 = core.stats(), time.monotonic()
                replica = Replica("engine", core, make_admission(admission, core))
                label = f"real {policy} c={c}" + (f" ({round_ + 1})" if cmp.repeat > 1 else "")
                records = run_real(replica, specs, prompts, c, label=label)
                at = (t0 + time.monotonic()) / 2 - started
                after_stats = core.stats()
                real = summarize(records, SLO())
                real.update(
                    preemptions=after_stats.preemptions - before_stats.preemptions,
                    recomputed_tokens=after_stats.recomputed_tokens
                    - before_stats.recomputed_tokens,
                    spilled_bytes=after_stats.spilled_bytes - before_stats.spilled_bytes,
                    at_s=at,  # the simulated point's speed factor is the first round's
                )
                core.check_integrity()
                runs[c].append((real, at))
        core.close()
        nxt = cmp.policies[i + 1] if i + 1 < len(cmp.policies) else None
        after = probe(nxt)
        for c, done in runs.items():
            specs, reals, at = cmp.specs(c), [real for real, _ in done], done[0][1]
            profile, factor = cmp.profile, None
            if before is not None and after is not None:
                factor = between(before, after, at)
                if cmp.rescale:
                    profile = cmp.profile.engine_scaled(factor)
            setup = Setup(config, profile, Topology(), args, seed=cmp.seed)
            sims = cmp.simulate(setup, policy, specs, c, f"sim {policy} c={c}")
            point = cmp.point("engine", policy, c, reals, sims)
            point["at_s"] = at
            if factor is not None:
                point["engine_factor"] = factor
            points.append(point)
        before = after
    return points, probes


def between(before: dict, after: dict, at: float) -> float:
    """The probes' measured-over-profile factor at time `at` (seconds into the run), linear
    between the probe before and the probe after (their own middles), held at the ends."""
    x0, x1 = before["measured_over_profile"], after["measured_over_profile"]
    t0, t1 = before["at_s"], after["at_s"]
    if t1 <= t0:
        return x0
    return x0 + (x1 - x0) * min(1.0, max(0.0, (at - t0) / (t1 - t0)))


def bench_sim_vs_real(
    model: str,
    profile: Profile,
    concurrencies=(2, 8, 16),
    policies=POLICIES,
    num_kv_blocks: int = 48,
    requests: int = 24,
    mean_output: int | None = None,
    seed: int = 0,
    cluster: bool = False,
    decode_workers: int = 1,
    engine: bool = True,
    rescale: bool = False,
    repeat: int = 1,
) -> dict:
    """Both halves (the engine's unless `engine` is False; the cluster's, 1P`decode_workers`D,
    with `cluster`) -> the report. `rescale`: each engine point simulated with the profile's
    engine step costs scaled by the engine probes' factor interpolated at its time (probes
    before, between and after the policies' points: engine_points), and each launched
    cluster's decode and prefill costs by that cluster's probe (all measured in this run),
    the figures with the profile as given
    reported beside them (`unscaled` in each point). `repeat`: each point's real half run
    that many times (rounds of the loads in turn); the first is the comparison, and each
    point reports the runs' spread and where its simulated figures lie in it."""
    if decode_workers < 1:
        raise ValueError(f"decode_workers: at least 1, got {decode_workers}")
    if repeat < 1:
        raise ValueError(f"repeat: at least 1, got {repeat}")
    concurrencies = tuple(dict.fromkeys(concurrencies))  # a load named twice is one point
    if decode_workers > 1 and not cluster:
        raise ValueError("decode_workers: the cluster's, with --cluster")
    if not (engine or cluster):
        raise ValueError("nothing to compare: the engine half is off and --cluster not given")
    if rescale and profile.kind != "fitted":
        raise ValueError(f"rescale: profile {profile.name} is no fitted one")
    budget = num_kv_blocks * 16
    mean_output = mean_output or max(16, budget // 4)
    max_output = max(8, budget // 2 - 48)
    with tempfile.TemporaryDirectory(prefix="pdserve-simvreal-") as spill_dir:
        cmp = Comparison(
            model,
            profile,
            tuple(policies),
            tuple(concurrencies),
            num_kv_blocks,
            requests,
            mean_output,
            max_output,
            seed,
            spill_dir,
            decode_workers,
            rescale=rescale,
            repeat=repeat,
        )
        if cluster:
            from pdserve.sim.vs_cluster import check_cluster_costs, check_cluster_probe

            check_cluster_costs(cmp)  # before the probe's engine takes the device
            check_cluster_probe(cmp)
        # the engine's probes (a cluster-only run makes none: on a GPU its engine would
        # hold the device's memory while the cluster's workers start); each cluster's own
        # (pdserve/sim/vs_cluster.py): a cluster's speed did not move with the engine's
        points, drift = engine_points(cmp) if engine else ([], None)
        cluster_drift = None
        if cluster:
            from pdserve.sim.vs_cluster import cluster_points

            more, cluster_drift = cluster_points(cmp)
            points += more
    return {
        "benchmark": "sim-vs-real",
        "model": model,
        "profile": profile.name,
        "pool": {"num_kv_blocks": num_kv_blocks, "block_size": 16},
        "cluster": f"1P{decode_workers}D" if cluster else None,
        "workload": {"kind": "reasoning", "mean_output": mean_output, "max_output": max_output},
        "seed": seed,
        "bounds": dict(BOUNDS),
        "drift": drift or None,
        "cluster_drift": cluster_drift,
        "machine": machine_info(),
        "points": points,
        "misses": sum(len(p["misses"]) for p in points),
        "repeat": repeat,
        # --repeat: the misses that are the real runs' disagreement (spread_of)
        "misses_from_real_spread": (
            sum(p["misses_from_real_spread"] for p in points) if repeat > 1 else None
        ),
        "misses_unscaled_from_real_spread": (
            sum(p["unscaled"]["misses_from_real_spread"] for p in points)
            if repeat > 1 and rescale
            else None
        ),
        "rescaled": rescale,
        "misses_unscaled": (
            sum(len(p.get("unscaled", p)["misses"]) for p in points) if rescale else None
        ),
    }


def format_table(report: dict) -> str:
    lines = [
        f"simulator vs real runs, {report['model']}, profile {report['profile']}, "
        f"{report['pool']['num_kv_blocks']} blocks per worker"
        f"{', cluster ' + report['cluster'] if report.get('cluster') else ''}; "
        "sim / real per figure "
        f"(bounds: throughput and p50 {BOUNDS['p50']:.0%}, p99 {BOUNDS['p99']:.0%}, "
        f"cluster counts {BOUNDS['counts']:.0%})",
        f"{'kind':<7} {'policy':<18} {'conc':>4} {'tok/s':>6} {'TTFT50':>7} {'TPOT50':>7} "
        f"{'TTFT99':>7} {'TPOT99':>7} {'preempt':>8} {'recomp':>7}  misses",
    ]
    for p in report["points"]:
        r = p["ratio"]
        lines.append(
            f"{p['kind']:<7} {p['policy']:<18} {p['concurrency']:>4} "
            f"{r['throughput_tok_s']:>6.2f} {r['ttft_p50_s']:>7.2f} {r['tpot_p50_s']:>7.2f} "
            f"{r['ttft_p99_s']:>7.2f} {r['tpot_p99_s']:>7.2f} {r['preemptions']:>8.2f} "
            f"{r['recomputed_tokens']:>7.2f}  {len(p['misses'])}"
        )
    lines.append(f"{report['misses']} figures outside their bounds")
    if (report.get("repeat") or 1) > 1:
        lines.append(
            f"each point's real half ran {report['repeat']} times; the first is the comparison: "
            f"{report['misses_from_real_spread']} of the {report['misses']} figures outside "
            "their bounds are the real runs' disagreement (no single figure is within the "
            "bound of every run of the point, and the simulated one is within it of as many "
            "as any could be); the others are the model's error"
        )
    drift = report.get("drift")
    for probe in [drift] if isinstance(drift, dict) else drift or ():  # a dict: one, before all
        x = probe["measured_over_profile"]
        if "policy" not in probe:  # (reports before session 51: one probe before all)
            when = "before the runs"
        elif probe["policy"] is None:
            when = "after the last points"
        else:
            when = f"before its {probe['policy']} points"
        lines.append(
            f"this machine ran the engine's steps at {x:.2f}x the profile's time in a probe "
            f"{when} ({probe['steps']} steps)"
            + ("" if abs(x - 1) <= DRIFT else ": the profile is stale, calibrate again")
        )
    for probe in report.get("cluster_drift") or ():
        lines.append(_cluster_probe_line(probe))
    if report.get("rescaled"):
        halves = (report.get("drift") is not None, bool(report.get("cluster_drift")))
        scaled = {(True, True): "each half's", (False, True): "the cluster's"}.get(
            halves, "the engine's"
        )
        lines.append(
            f"the simulated figures are the profile's with {scaled} step costs scaled by the "
            "probes' factors (--rescale: an engine point's interpolated in time between the "
            "probes on either side of it, a cluster's from the probe before its policy's "
            "points, its decode steps by the probe's split where it has one); with the "
            "profile as given: "
            f"{report['misses_unscaled']} figures outside their bounds"
            + (
                f", {report['misses_unscaled_from_real_spread']} of them the real runs' "
                "disagreement"
                if report.get("misses_unscaled_from_real_spread") is not None
                else ""
            )
        )
    for p in report["points"]:
        for m in p["misses"]:
            lines.append(f"  {p['kind']} {p['policy']} c={p['concurrency']}: {m}")
    return "\n".join(lines)


def _cluster_probe_line(probe: dict) -> str:
    """One launched cluster's probe: measured over the profile's time per part, whether it
    is stale (a part --rescale would not use, too few prefill batches, says so and is not
    counted), or why it was skipped."""
    head = f"the {probe['policy']} cluster's probe"
    if "skipped" in probe:
        return f"{head}: skipped ({probe['skipped']})"
    parts, worst = [], 0.0
    for part in ("decode", "prefill"):
        seen = probe.get(part)
        if seen is None:
            continue
        x = seen["measured_over_profile"]
        used = seen.get("used", True)
        parts.append(f"{part} {x:.2f}x ({seen['steps']}{'' if used else ', too few: not used'})")
        worst = max(worst, abs(x - 1)) if used else worst
    split = probe.get("split")
    if split is not None:  # (probes before session 53 have none)
        small, large = split["small"], split["large"]
        parts.append(
            f"batches <= {SMALL} {small['measured_over_profile']:.2f}x ({small['steps']}), "
            f">= {LARGE} {large['measured_over_profile']:.2f}x ({large['steps']}): split "
            f"{split['base']:.2f}x whatever the batch, {split['per_seq']:.2f}x per sequence"
        )
        # (per_seq is a line carried out far past its points, noisy: not a staleness sign)
        worst = max(worst, abs(large["measured_over_profile"] - 1))
    preempted = probe.get("preemptions") or 0
    if preempted:
        parts.append(
            f"{preempted:.0f} preemptions while it ran (a recompute or a reload inside steps "
            "it read as pure decode)"
        )
    return f"{head}: the cluster ran at the profile's time times {', '.join(parts)}" + (
        "" if worst <= DRIFT else ": the profile is stale, calibrate again"
    )
