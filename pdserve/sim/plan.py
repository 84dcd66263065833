"""`pdserve plan`: search serving layouts in the simulator, best first by SLO goodput.

For G GPUs of one profile the candidates are

    layouts     TP=k for every k dividing G that splits the model's heads and whose weight
                shard leaves room for KV (the others are reported, not searched), as G/k
                colocated replicas (DP) or as n prefill : m decode workers (n + m = G/k);
                for MLA models also TP=k with attention data-parallel over the k ranks
    admission   greedy or kv-aware, preempting by recompute, host swap or the full tiers
    settings    max_num_seqs, and the host spill tier's size

and the search runs in three rounds so that it answers in about a minute:

    1. every layout with kv-aware+tiered on a sample of the workload
    2. the best layouts x every admission policy x settings, on the same sample
    3. the winner re-simulated on the whole workload; that figure is the one printed

Every figure is SIMULATED with the named profile; the ranking is by requests per second
that met the SLO (TTFT and TPOT), ties broken by throughput.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from pdserve.bench.slo import SLO
from pdserve.bench.workload import RequestSpec
from pdserve.config import ModelConfig
from pdserve.engine.args import EngineArgs
from pdserve.progress import progress
from pdserve.sim.engine import per_device_config
from pdserve.sim.profile import Profile
from pdserve.sim.run import Setup, Topology, simulate

POLICIES = ("kv-aware+tiered", "kv-aware+swap", "greedy+recompute", "greedy+tiered")
MAX_NUM_SEQS = (256, 512)
HOST_TIER = (None, 1)  # host spill tier: the default (4x the device pool), or the pool's size


@dataclass(frozen=True)
class Candidate:
    topology: Topology
    policy: str = POLICIES[0]
    max_num_seqs: int = 256
    host_tier_x: int | None = None  # the host tier as a multiple of the device pool

    def describe(self) -> str:
        tier = "" if self.host_tier_x is None else f", host tier {self.host_tier_x}x pool"
        return f"{self.topology.describe()}: {self.policy}, max_num_seqs {self.max_num_seqs}{tier}"


def tp_refusals(
    config: ModelConfig, profile: Profile, gpus: int, weight_bytes: float
) -> dict[int, str | None]:
    """Every TP degree dividing `gpus` -> why the model cannot run at it (its heads do not
    split that many ways, or its weight shard leaves no room for KV), or None."""
    if gpus < 1:
        raise ValueError(f"gpus: must be >= 1, got {gpus}")
    out: dict[int, str | None] = {}
    for tp in (k for k in range(1, gpus + 1) if gpus % k == 0):
        setup = Setup(config, profile, Topology(tp=tp), EngineArgs(), weight_bytes)
        try:
            per_device_config(config, tp)
            setup.num_blocks()
        except ValueError as e:
            out[tp] = str(e)
        else:
            out[tp] = None
    return out


def layouts(config: ModelConfig, profile: Profile, gpus: int, weight_bytes: float):
    """Every topology of `gpus` GPUs the model runs on, colocated and disaggregated."""
    refusals = tp_refusals(config, profile, gpus, weight_bytes)
    out = []
    for tp, refused in refusals.items():
        if refused:
            continue
        workers = gpus // tp
        out.append(Topology(dp=workers, tp=tp))
        if config.mla is not None and tp > 1 and profile.kind == "roofline":
            # how MLA models are served: the latent does not split under TP
            dp_attn = Topology(dp=workers, tp=tp, dp_attention=True)
            try:
                Setup(config, profile, dp_attn, EngineArgs(), weight_bytes).num_blocks()
            except ValueError:  # the attention weights whole on each rank leave no room
                pass
            else:
                out.append(dp_attn)
        for prefill in sorted({1, workers // 4, workers // 2} - {0}):
            if prefill < workers:
                out.append(Topology(tp=tp, prefill=prefill, decode=workers - prefill))
    if not out:
        why = "; ".join(f"TP={tp}: {r}" for tp, r in refusals.items())
        hint = "; more GPUs or fp8 weights (--weight-dtype fp8)" if weight_bytes > 1 else ""
        raise ValueError(
            f"gpus: {config.architecture} does not fit {gpus} x {profile.name} at any TP "
            f"({why}){hint}"
        )
    return out


def _setup(base: Setup, c: Candidate) -> Setup:
    args = dataclasses.replace(base.args, max_num_seqs=c.max_num_seqs)
    setup = dataclasses.replace(base, topology=c.topology, args=args)
    if c.host_tier_x is not None:
        blocks = setup.num_blocks()
        setup = dataclasses.replace(
            setup, args=dataclasses.replace(args, spill_host_blocks=c.host_tier_x * blocks)
        )
    return setup


def score(point: dict) -> tuple[float, float]:
    return point["goodput_req_s"], point["throughput_tok_s"]


def evaluate(base: Setup, c: Candidate, specs: list[RequestSpec], concurrency: int | None):
    point = simulate(_setup(base, c), c.policy, specs, concurrency, label="")
    point.pop("series")
    return point


def plan(
    config: ModelConfig,
    profile: Profile,
    gpus: int,
    specs: list[RequestSpec],
    concurrency: int | None,
    slo: SLO,
    args: EngineArgs | None = None,
    weight_bytes: float = 2,
    sample: int = 400,
    keep: int = 2,
    seed: int = 0,
    label: str = "",
) -> dict:
    """Search, then confirm the winner on every request of `specs` -> the report."""
    started = time.perf_counter()
    base = Setup(config, profile, Topology(), args or EngineArgs(), weight_bytes, slo, seed)
    shown = specs[:sample]
    tried: list[tuple[Candidate, dict]] = []

    def run_round(cands: list[Candidate], desc: str) -> None:
        for c in progress(cands, desc=desc, unit="layout"):
            tried.append((c, evaluate(base, c, shown, concurrency)))

    run_round([Candidate(t) for t in layouts(config, profile, gpus, weight_bytes)], "plan: layouts")
    ranked = sorted(tried, key=lambda cp: score(cp[1]), reverse=True)
    best_layouts = list(dict.fromkeys(c.topology for c, _ in ranked))[:keep]
    seen = {c for c, _ in tried}
    second = [
        Candidate(t, policy, seqs, tier)
        for t in best_layouts
        for policy in POLICIES
        for seqs in MAX_NUM_SEQS
        for tier in HOST_TIER
        if (policy.endswith("tiered") or policy.endswith("swap") or tier is None)
    ]
    run_round([c for c in second if c not in seen], "plan: settings")
    ranked = sorted(tried, key=lambda cp: score(cp[1]), reverse=True)
    winner, predicted = ranked[0]
    confirmed = evaluate(base, winner, specs, concurrency)
    return {
        "benchmark": "plan",
        "simulated": True,
        "profile": {"name": profile.name, "kind": profile.kind},
        "model": label or config.architecture,
        "gpus": gpus,
        "slo": dataclasses.asdict(slo),
        "concurrency": concurrency,
        "requests": {"searched": len(shown), "confirmed": len(specs)},
        "ranked": [_row(c, p) for c, p in ranked],
        "best": {**_row(winner, confirmed), "searched": _row(winner, predicted)},
        "candidates": len(tried),
        "skipped_tp": {
            str(tp): r for tp, r in tp_refusals(config, profile, gpus, weight_bytes).items() if r
        },
        "wall_s": time.perf_counter() - started,
    }


def _row(c: Candidate, p: dict) -> dict:
    keys = (
        "goodput_req_s",
        "throughput_tok_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "tpot_p99_s",
        "e2e_p50_s",
        "preemptions",
        "recomputed_tokens",
        "spilled_bytes",
        "num_kv_blocks",
        "errors",
    )
    return {
        "layout": c.describe(),
        "topology": dataclasses.asdict(c.topology),
        "policy": c.policy,
        "max_num_seqs": c.max_num_seqs,
        "host_tier_x": c.host_tier_x,
        **{k: p[k] for k in keys if k in p},
    }


def format_plan(report: dict, top: int = 8) -> str:
    slo = report["slo"]
    lines = [
        f"SIMULATED plan: {report['model']} on {report['gpus']} x {report['profile']['name']}, "
        f"SLO TTFT <= {slo['ttft_s']} s and TPOT <= {slo['tpot_s']} s; "
        f"{report['candidates']} candidates on {report['requests']['searched']} requests",
        f"{'#':>2} {'good req/s':>10} {'tok/s':>9} {'TTFT p99':>9} {'TPOT p99':>9} "
        f"{'preempt':>8}  layout",
    ]
    groups: dict[tuple, list[dict]] = {}  # settings that changed nothing share one line
    for r in report["ranked"]:
        figures = tuple(r[k] for k in ("goodput_req_s", "throughput_tok_s", "ttft_p99_s",
                                       "tpot_p99_s", "preemptions", "topology"))  # fmt: skip
        groups.setdefault(repr(figures), []).append(r)
    for i, same in enumerate(list(groups.values())[:top], 1):
        r = same[0]
        also = f" (and {len(same) - 1} other settings, same figures)" if len(same) > 1 else ""
        lines.append(
            f"{i:>2} {r['goodput_req_s']:>10.2f} {r['throughput_tok_s']:>9.0f} "
            f"{r['ttft_p99_s']:>8.2f}s {r['tpot_p99_s'] * 1e3:>7.1f}ms {r['preemptions']:>8}  "
            f"{r['layout']}{also}"
        )
    for tp, why in report.get("skipped_tp", {}).items():
        lines.append(f"   not searched: TP={tp} ({why})")
    b = report["best"]
    lines.append(
        f"best: {b['layout']}; confirmed on all {report['requests']['confirmed']} requests: "
        f"{b['goodput_req_s']:.2f} good req/s, {b['throughput_tok_s']:.0f} tok/s, TTFT p50 "
        f"{b['ttft_p50_s']:.2f} s, TPOT p50 {b['tpot_p50_s'] * 1e3:.1f} ms "
        f"(searched: {b['searched']['goodput_req_s']:.2f} good req/s); "
        f"planned in {report['wall_s']:.0f} s"
    )
    return "\n".join(lines)
