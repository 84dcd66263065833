"""A simulated capacity sweep: policies x concurrency on one setup, reported like
`bench sweep` (the same fields, plots and analysis) and labelled simulated with its profile.

    report = sim_sweep(setup, ["greedy+recompute", "kv-aware+tiered"], [1, 8, 64], load)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.bench.sweep import analyze
from pdserve.bench.workload import WORKLOADS, RequestSpec, specs_of
from pdserve.progress import progress
from pdserve.sim.run import Setup, check_lengths, simulate


@dataclass(frozen=True)
class Load:
    """What each point sends: a built-in workload (`kind`, `requests_per_client` x c, at
    least `min_requests`; trace lengths as recorded unless `native` is False) or a workload
    file's rows (`specs`)."""

    kind: str = "reasoning"
    requests_per_client: int = 2
    min_requests: int = 8
    mean_output: int = 128
    max_output: int | None = None
    native: bool = True  # trace lengths as recorded (False: scaled down as bench sweep does)
    specs: tuple[RequestSpec, ...] = ()  # from a file: these, for every point
    source: str = ""

    def __post_init__(self) -> None:
        if not self.specs and self.kind not in WORKLOADS:
            raise ValueError(
                f"workload: unknown {self.kind!r}; choose one of {', '.join(WORKLOADS)}"
            )

    def for_point(self, concurrency: int | None, seed: int) -> list[RequestSpec]:
        if self.specs:
            return list(self.specs)
        n = max(self.min_requests, self.requests_per_client * (concurrency or 1))
        return specs_of(
            self.kind, n, seed + (concurrency or 0), self.mean_output, self.max_output, self.native
        )

    def describe(self) -> dict:
        if self.specs:
            return {"file": self.source, "requests": len(self.specs)}
        out = dataclasses.asdict(self)
        out.pop("specs")
        out.pop("source")
        return out


def sim_sweep(
    setup: Setup,
    policies: list[str],
    concurrencies: list[int | None],
    load: Load,
    label: str = "sim",
) -> dict:
    points = []
    # each point's requests, the same for every policy; a cap they do not fit is said
    # before anything runs
    specs = {c: load.for_point(c, setup.seed) for c in concurrencies}
    for c in concurrencies:
        check_lengths(setup, specs[c])
    grid = [(p, c) for p in policies for c in concurrencies]
    for policy, c in progress(grid, desc="pdserve sim", unit="point"):
        points.append(simulate(setup, policy, specs[c], c, label=f"{policy} c={c}"))
    topo = setup.topology
    lengths = (
        "max_tokens = each request's length"
        if setup.max_tokens is None
        else f"max_tokens {setup.max_tokens}, lengths hidden"
    )
    title = (
        f"SIMULATED: {label} ({setup.config.architecture}) on {setup.profile.name} "
        f"({topo.describe()}), {points[0]['num_kv_blocks']} KV blocks of "
        f"{setup.args.block_size} tokens per engine, {lengths}"
    )
    return {
        "benchmark": "sim",
        "simulated": True,
        "title": title,
        "model": label,
        "profile": {
            "name": setup.profile.name,
            "kind": setup.profile.kind,
            "sources": setup.profile.sources,
            "shares_cpus": setup.profile.shares_cpus,
        },
        "turn_s": setup.turn_s if setup.profile.shares_cpus else None,
        "topology": dataclasses.asdict(topo),
        "engine_args": {
            "block_size": setup.args.block_size,
            "enable_prefix_caching": setup.args.enable_prefix_caching,
            "max_num_seqs": setup.args.max_num_seqs,
            "max_num_batched_tokens": setup.args.max_num_batched_tokens,
        },
        "workload": load.describe(),
        # None: each request's max_tokens was its length (a policy reading the cap knew it)
        "max_tokens": setup.max_tokens,
        "slo": dataclasses.asdict(setup.slo),
        "points": points,
        "analysis": analyze([p for p in points if p["concurrency"] is not None]),
        "steps": sum(p["steps"] for p in points),
        "wall_s": sum(p["wall_s"] for p in points),
    }


def format_table(report: dict) -> str:
    lines = [
        report["title"],
        f"{'policy':<24} {'conc':>5} {'tok/s':>9} {'good req/s':>10} {'TTFT p50':>9} {'p99':>8} "
        f"{'TPOT p50':>9} {'p99':>8} {'preempt':>8} {'recomp':>9} {'spilled GB':>10} {'moved':>5}",
    ]
    for p in report["points"]:
        lines.append(
            f"{p['policy']:<24} {str(p['concurrency']):>5} {p['throughput_tok_s']:>9.1f} "
            f"{p['goodput_req_s']:>10.2f} {p['ttft_p50_s']:>9.3f} {p['ttft_p99_s']:>8.2f} "
            f"{p['tpot_p50_s'] * 1e3:>7.1f}ms {p['tpot_p99_s'] * 1e3:>6.1f}ms "
            f"{p['preemptions']:>8} {p['recomputed_tokens']:>9} {p['spilled_bytes'] / 1e9:>10.2f} "
            f"{p.get('migrations', 0):>5}"
        )
    steps, wall = report["steps"], report["wall_s"]
    lines.append(
        f"simulated {steps} steps in {wall:.1f} s ({steps / wall if wall else 0:.0f} steps/s); "
        f"SLO TTFT <= {report['slo']['ttft_s']} s, TPOT <= {report['slo']['tpot_s']} s"
    )
    return "\n".join(lines)
