"""`pdserve bench sweep`: the capacity trap, measured.

For each policy (`admission+preemption`, e.g. `greedy+recompute`, `kv-aware+tiered`, or
`default`; `+migrate` after either turns on the router's live-migration rebalancer,
`--migrate-policy pressure`, docs/migration.md) a local cluster is launched with that policy
on its decode workers and a small device KV budget, all of them before the first point. The
load is a closed loop or an open one: for each concurrency every policy in turn gets that
many clients, each sending its next request when the last one ends; for each arrival rate
(`rates`, requests/s) every policy gets the same requests sent at Poisson arrival times
whatever the cluster does, which is where SLO goodput separates policies (in a closed loop
past the knee every policy's requests queue alike and TTFT fails for all). The requests are
the same for every policy at a point (the reasoning workload by default: short prompts,
long-tailed outputs, mean scaled to the KV budget), and the point records throughput in its
busy window (`steady_throughput`; the whole run's rate, drain included, is `overall_tok_s`),
TTFT, TPOT and end-to-end percentiles, SLO goodput, every request's record, and what the
decode workers report for the point (preemptions, recomputed tokens, spilled bytes: counter
deltas scraped from their Prometheus endpoints; the default policy's inputs: its gauges).
After every point the sweep waits until every worker's blocks and every spill tier are empty
again, and fails if they do not (a leak).

Skewed arrivals (two or more decode workers): at every point every decode worker but one is
drained (it gets no new requests, as a replica still starting up) and joins later:
`skew="late-join"` once half the point's requests were sent; `skew="scale-out"` (closed loop)
once the first wave, one request per client, is streaming, all of it on the first worker (a
burst that landed on one replica before the others came up). The first one fills while the
others stand idle or take only what arrives after, which is where moving running requests
(`+migrate`) pays.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from types import MappingProxyType

from pdserve.bench import prometheus
from pdserve.bench.report import machine_info, write_json
from pdserve.bench.serve import Midway, _drive, percentile
from pdserve.bench.slo import DEFAULT_SWEEP_SLO, SLO, goodput, parse_slo
from pdserve.bench.workload import make_workload, max_prompt_tokens
from pdserve.config import DEFAULT_PREEMPTION
from pdserve.engine.admission import DEFAULT_ADMISSION
from pdserve.progress import progress

DEFAULT_POLICY = "default"  # what a decode worker runs when given no policy flags
DEFAULT_POLICIES = ("greedy+recompute", "greedy+tiered", DEFAULT_POLICY)
COUNTERS = MappingProxyType(
    {
        "preemptions": "pdserve_decode_preemptions_total",
        "rotations": "pdserve_decode_rotations_total",
        "recomputed_tokens": "pdserve_decode_recomputed_tokens_total",
        "spilled_bytes": "pdserve_decode_spilled_bytes_total",
        "refused": "pdserve_decode_admission_refused_total",
        "migrated_bytes": "pdserve_decode_migrated_bytes_total",
    }
)
MIGRATE = "+migrate"
SKEWS = ("late-join", "scale-out")


def parse_policy(policy: str) -> tuple[str, str]:
    from pdserve.config import PREEMPTION
    from pdserve.engine.admission import ADMISSION

    """`admission+preemption[+migrate]` -> (admission, preemption); the router's part, the
    live-migration rebalancer, is split_migrate()'s."""
    policy, _ = split_migrate(policy)
    admission, sep, preemption = policy.partition("+")
    if not sep or admission not in ADMISSION:
        raise ValueError(
            f"policy: {policy!r} is not admission+preemption, e.g. greedy+recompute "
            f"(admission: {', '.join(ADMISSION)})"
        )
    if preemption not in PREEMPTION:
        raise ValueError(f"policy: preemption {preemption!r}; choose {', '.join(PREEMPTION)}")
    return admission, preemption


def split_migrate(policy: str) -> tuple[str, bool]:
    """`kv-aware+tiered+migrate` -> ("kv-aware+tiered", True)."""
    if policy.endswith(MIGRATE):
        return policy.removesuffix(MIGRATE), True
    return policy, False


def _samples(address: str):
    """Every sample a worker's /metrics endpoint serves now."""
    return prometheus.samples(prometheus.scrape(address))


def scrape(addresses: list[str]) -> dict[str, float]:
    """Sum of the decode workers' counters (and spill blocks in use) right now."""
    totals = {k: 0.0 for k in COUNTERS} | {"spill_used_blocks": 0.0, "migrations": 0.0}
    names = {v: k for k, v in COUNTERS.items()}
    for address in addresses:
        for sample in _samples(address):
            if sample.name in names:
                totals[names[sample.name]] += sample.value
            elif sample.name == "pdserve_decode_spill_used_blocks":
                totals["spill_used_blocks"] += sample.value
            elif (
                sample.name == "pdserve_decode_migrations_total"
                and sample.labels.get("outcome") == "completed"
            ):  # moves out of the worker
                totals["migrations"] += sample.value
    return totals


POLICY_PREFIX = "pdserve_decode_policy_"


def scrape_policy(addresses: list[str]) -> list[dict]:
    """Each decode worker's policy gauges now, by name without the prefix (`step_seconds`,
    `overcommit_blocks`, ...; per tier under `park_seconds_per_block`); {} for a worker
    that runs no cost-aware policy (decode/metrics.py names them all)."""
    out = []
    for address in addresses:
        seen: dict = {}
        for sample in _samples(address):
            if not sample.name.startswith(POLICY_PREFIX):
                continue
            name = sample.name.removeprefix(POLICY_PREFIX)
            if "tier" in sample.labels:
                seen.setdefault(name, {})[sample.labels["tier"]] = sample.value
            else:
                seen[name] = sample.value
        out.append(seen)
    return out


def wait_drained(cluster, decode_metrics: list[str], timeout_s: float = 60.0) -> None:
    """Every block free on every worker and every spill tier empty, or AssertionError."""
    from pdserve.client import Client

    deadline = time.monotonic() + timeout_s
    with Client(cluster.address) as client:
        while True:
            workers = client.workers()
            blocks_free = all(w.free_blocks == w.total_blocks for w in workers)
            spilled = scrape(decode_metrics)["spill_used_blocks"]
            if blocks_free and spilled == 0:
                return
            if time.monotonic() > deadline:
                held = [(w.worker_id, w.total_blocks - w.free_blocks) for w in workers]
                raise AssertionError(
                    f"leak after a sweep point: blocks held {held}, spill blocks {spilled}"
                )
            time.sleep(0.5)


def steady_throughput(samples, open_loop: bool = False) -> tuple[float, float]:
    """(tokens/s, window s) in the busy window. Closed loop: while every client had a
    request in flight, from the first request sent until the first request that ends after
    the last one was sent (until then a client that finished took the next request at once).
    Open loop: from the first request sent to the last (arrivals still coming). After that
    the load drains, and with long-tailed outputs the drain is one long request decoding
    alone. Tokens are counted by the time they arrived (`token_times`); a record without
    them (the simulator's) is assumed to get its tokens evenly between its first and last
    token."""
    ok = [s for s in samples if s.error is None and s.output_tokens > 0]
    if not ok:
        return 0.0, 0.0
    start, end = min(s.sent_at for s in ok), _busy_end(ok, open_loop)
    if end <= start:
        return 0.0, 0.0
    return tokens_between(ok, float("-inf"), end) / (end - start), end - start


def warm_throughput(samples, concurrency: int) -> tuple[float | None, float]:
    """(tokens/s, window s) in the closed loop's busy window after its first wave: from the
    moment as many requests have ended as there are clients. Every request of the first
    wave starts with an empty context at once, so the busy window's start holds more
    requests than the pool can in a steady state (contexts spread over their lives): with
    long outputs and few requests per client that start is most of the window (a simulated
    H200 run at 50 clients: 1,444 tok/s with 2 requests each, 847 with 6, 775 after the
    first wave). None unless as many requests again end inside that window: with two
    requests per client it is a moment, not a state (a few tokens over a fraction of a
    second read as hundreds of tokens per second)."""
    ok = [s for s in samples if s.error is None and s.output_tokens > 0]
    ends = sorted(s.end_at for s in ok)
    if len(ends) <= concurrency:
        return None, 0.0
    start, end = ends[concurrency - 1], _busy_end(ok, False)
    if (
        end <= start
        or bisect.bisect_right(ends, end) - bisect.bisect_right(ends, start) < concurrency
    ):
        return None, 0.0
    return tokens_between(ok, start, end) / (end - start), end - start


def _busy_end(ok, open_loop: bool) -> float:
    last_sent = max(s.sent_at for s in ok)
    if open_loop:
        return last_sent
    return min((s.end_at for s in ok if s.end_at > last_sent), default=last_sent)


def tokens_between(ok, start: float, end: float) -> float:
    """Output tokens that arrived in (start, end], by `token_times` or spread evenly from a
    record's first token to its last."""
    tokens = 0.0
    for s in ok:
        if s.first_at > end or s.end_at < start:
            continue
        times = getattr(s, "token_times", None)
        if times:
            tokens += bisect.bisect_right(times, end) - bisect.bisect_right(times, start)
            continue
        tokens += _evenly(s, end) - _evenly(s, start)
    return tokens


def _evenly(s, t: float) -> float:
    """Tokens a record without token times had at time t (its first at first_at, the rest
    evenly until end_at)."""
    if t < s.first_at:  # -inf: none
        return 0.0
    span = s.end_at - s.first_at
    inside = 1.0 if span <= 0 else min(1.0, (t - s.first_at) / span)
    return 1 + (s.output_tokens - 1) * inside


def load_of(point: dict) -> float:
    """A point's place on the load axis: its arrival rate (open loop) or its clients."""
    rate = point.get("rate")
    return rate if rate is not None else point["concurrency"]


def run_point(
    address, work, concurrency: int | None, seed: int, rate: float | None = None, midway=None
):
    """One point: `concurrency` closed-loop clients, or arrivals at `rate` requests/s;
    `midway`: a Midway (skewed arrivals: when the late decode workers join)."""
    samples, elapsed = asyncio.run(_drive(address, work, concurrency, rate, seed, midway=midway))
    ok = [s for s in samples if s.error is None]
    steady, window = steady_throughput(samples, open_loop=rate is not None)
    warm, warm_window = (None, 0.0) if rate is not None else warm_throughput(samples, concurrency)
    errors = sorted({s.error for s in samples if s.error})[:3]
    tokens = sum(s.output_tokens for s in ok)
    ttft = [s.ttft_s for s in ok]
    tpot = [s.tpot_s for s in ok if s.output_tokens > 1]
    e2e = [s.e2e_s for s in ok]
    t0 = min((s.sent_at for s in samples), default=0.0)
    return {
        "num_requests": len(samples),
        "errors": len(samples) - len(ok),
        "error_examples": errors,
        "elapsed_s": elapsed,
        "generated_tokens": tokens,
        "throughput_tok_s": steady,
        "steady_window_s": window,
        "warm_tok_s": warm,
        "warm_window_s": warm_window,
        "overall_tok_s": tokens / elapsed if elapsed else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        # sent_s: when each was sent, seconds from the point's first send
        "requests": [s.record() | {"sent_s": s.sent_at - t0} for s in samples],
    }


def policy_flags(policy: str) -> list[str]:
    """The decode worker's flags for a policy; `default` is no flags at all."""
    policy, _ = split_migrate(policy)
    if policy == DEFAULT_POLICY:
        return []
    admission, preemption = parse_policy(policy)
    return ["--admission", admission, "--preemption", preemption]


def router_flags(policy: str) -> list[str]:
    """The router's flags for a policy: the rebalancer on for a `+migrate` one."""
    return ["--migrate-policy", "pressure"] if split_migrate(policy)[1] else []


class LateJoin:
    """Skewed arrivals on one cluster: every decode worker but the first (by id) is drained
    before a point and joins midway."""

    def __init__(self, cluster) -> None:
        from pdserve.client import Client

        self.cluster = cluster
        with Client(cluster.address, security=cluster.security) as client:
            ids = sorted(w.worker_id for w in client.workers() if w.role == "decode")
        self.late = ids[1:]

    def hold(self) -> None:
        self._each(undo=False)

    def join(self) -> None:
        self._each(undo=True)

    def _each(self, undo: bool) -> None:
        from pdserve.serving.drain import drained

        for worker_id in self.late:  # idle ones drain at once
            if not drained(self.cluster.address, self.cluster.security, worker_id, undo):
                raise RuntimeError(f"{worker_id} did not drain (requests left on it)")


def bench_sweep(
    model: str,
    policies: list[str],
    concurrency: list[int] | None,
    prefill: int = 1,
    decode: int = 1,
    num_kv_blocks: int = 64,
    block_size: int = 16,
    requests_per_client: int = 2,
    min_requests: int = 4,
    mean_output: int | None = None,
    max_output: int | None = None,
    seed: int = 0,
    spill_dir: str | None = None,
    workload: str = "reasoning",
    slo: SLO | None = None,
    partial_json: str | None = None,
    rates: list[float] | None = None,
    requests_per_rate: int = 48,
    skew: str | None = None,
    share_cpus: bool | None = None,
    router_idle: bool | None = None,
    prefill_args: list[str] | None = None,
) -> dict:
    """`concurrency` (closed-loop clients per point) or `rates` (open-loop arrivals per
    second per point, `requests_per_rate` requests each), not both. `mean_output` defaults
    to a quarter of one decode worker's KV budget in tokens, so a handful of requests fill
    it: the trap appears at small loads on a small machine; `max_output` (default: what
    leaves the longest prompt half a worker's pool) may reach what one request alone fills.
    `slo` (default DEFAULT_SWEEP_SLO) may be relative: multiples of the unloaded TTFT and
    TPOT p50, those of the first policy's lowest-load point. `partial_json`: the report so
    far is written there after every point (a sweep stopped midway keeps what it measured).
    `skew`: None (the router spreads the load) or "late-join" (see the module's doc);
    `share_cpus`: each cluster's workers compute in turns, `router_idle`: its router at idle
    priority (None: as launch does); `prefill_args`: flags for every prefill worker (e.g.
    `--turn-s 0`), recorded in the report."""
    from pdserve.launch import Cluster
    from pdserve.weights import resolve

    for p in policies:
        policy_flags(p)
    for flag in prefill_args or []:
        if flag.split("=")[0] in ("--num-kv-blocks", "--block-size"):
            raise ValueError(
                f"prefill_args: {flag} is the sweep's own (--num-kv-blocks, --block-size)"
            )
    if bool(concurrency) == bool(rates):
        raise ValueError("load: give concurrency (closed loop) or rates (open loop), one of them")
    if concurrency and min(concurrency) < 1:
        raise ValueError(f"concurrency: positive integers, got {concurrency}")
    if rates and not all(0 < r < float("inf") for r in rates):
        raise ValueError(f"rate: positive requests per second, got {rates}")
    if skew is not None and skew not in SKEWS:
        raise ValueError(f"skew: {skew!r}; choose {', '.join(SKEWS)}")
    if skew is not None and decode < 2:
        raise ValueError(f"skew: {skew} needs two or more decode workers, got {decode}")
    if skew == "scale-out" and rates:
        raise ValueError("skew: scale-out joins after the first wave of a closed loop: no --rate")
    if rates and requests_per_rate < 1:
        raise ValueError(f"requests_per_rate: at least 1, got {requests_per_rate}")
    loads: list[tuple[int | None, float | None]] = (
        [(c, None) for c in concurrency] if concurrency else [(None, r) for r in rates]
    )
    slo = slo or parse_slo(DEFAULT_SWEEP_SLO)
    budget_tokens = num_kv_blocks * block_size
    mean_output = mean_output or max(16, budget_tokens // 4)
    # by default one request alone always fits half a pool: prompt + output
    if max_output is None:
        max_output = max(8, budget_tokens // 2 - max_prompt_tokens(workload))
    if max_output < 1 or max_prompt_tokens(workload) + max_output > budget_tokens:
        raise ValueError(
            f"num_kv_blocks: {num_kv_blocks} blocks of {block_size} tokens cannot hold one "
            f"{workload} prompt (up to {max_prompt_tokens(workload)} tokens) and its output "
            f"(up to {max_output})"
        )
    vocab = resolve(model).config.vocab_size
    points: list[dict] = []
    clusters: dict = {}  # policy -> its cluster
    cpus: dict = {}  # policy -> how its cluster uses the CPUs (read once it is up)

    def report(points: list[dict]) -> dict:
        return {
            "benchmark": "sweep",
            "model": model,
            "cluster": {
                "prefill": prefill,
                "decode": decode,
                "num_kv_blocks": num_kv_blocks,
                "block_size": block_size,
                "share_cpus": any(c["share_cpus"] for c in cpus.values()),
                "router_idle": any(c["router_idle"] for c in cpus.values()),
                "prefill_args": list(prefill_args or []),
            },
            "workload": {
                "kind": workload,
                "mean_output": mean_output,
                "max_output": max_output,
                "seed": seed,
                "requests_per_client": requests_per_client,
                "min_requests": min_requests,
                "loop": "closed" if concurrency else "open",
                "requests_per_rate": requests_per_rate if rates else None,
                "skew": skew,
            },
            "default_policy": f"{DEFAULT_ADMISSION}+{DEFAULT_PREEMPTION}",
            "slo": apply_slo(points, slo),
            "machine": machine_info(),
            "points": points,
            "analysis": analyze(points),
        }

    bar = progress(total=len(policies) * len(loads), desc="bench sweep", unit="point")
    with contextlib.ExitStack() as stack:
        # every policy's cluster is up at once (idle ones cost nearly no CPU) and the points
        # interleave, each concurrency running every policy in turn (the order rotating),
        # so that a slow spell of a shared machine hits every policy alike
        for policy in policies:
            decode_args = policy_flags(policy)
            if spill_dir:
                decode_args += ["--spill-dir", spill_dir]
            clusters[policy] = stack.enter_context(
                Cluster(
                    model,
                    prefill,
                    decode,
                    worker_args=[
                        "--num-kv-blocks",
                        str(num_kv_blocks),
                        "--block-size",
                        str(block_size),
                    ],
                    router_args=["--queue-timeout", "3600", "--max-queue", "4096"]
                    + router_flags(policy),
                    decode_args=decode_args,
                    prefill_args=prefill_args,
                    share_cpus=share_cpus,
                    router_idle=router_idle,
                )
            )
            cpus[policy] = clusters[policy].cpus()
        skewed = {p: LateJoin(c) for p, c in clusters.items()} if skew else {}
        for i, (c, rate) in enumerate(loads):
            n = max(min_requests, requests_per_client * c) if c else requests_per_rate
            # reasoning and long-prompt scale outputs to the pool; traces keep their own
            work = make_workload(n, vocab, seed + (c or i), workload, mean_output, max_output)
            for policy in policies[i % len(policies) :] + policies[: i % len(policies)]:
                cluster = clusters[policy]
                metrics = [a for k, a in cluster.metrics.items() if k.startswith("decode")]
                midway = None
                if policy in skewed:
                    skewed[policy].hold()
                    join = skewed[policy].join
                    midway = (
                        Midway(join, count=c, started=True)  # the first wave streams
                        if skew == "scale-out"
                        else Midway(join, count=len(work.prompts) // 2)  # half were sent
                    )
                before = scrape(metrics)
                point = run_point(cluster.address, work, c, seed, rate, midway)
                after = scrape(metrics)
                wait_drained(cluster, metrics)
                point.update(
                    {k: after[k] - before[k] for k in (*COUNTERS, "migrations")},
                    policy=policy,
                    concurrency=c,
                    rate=rate,
                    policy_inputs=scrape_policy(metrics),
                )
                points.append(point)
                points.sort(key=lambda p: (policies.index(p["policy"]), load_of(p)))
                bar.update(1)
                if partial_json:
                    write_json(report(points), partial_json)
    bar.close()
    return report(points)


def rescore(report: dict, slo: SLO) -> dict:
    """A sweep report scored again under another SLO, from its per-request records."""
    points = report["points"]
    return {**report, "slo": apply_slo(points, slo), "points": points}


def apply_slo(points: list[dict], slo: SLO) -> dict:
    """Goodput on every point: under `slo` (the point's goodput_req_s / goodput_tok_s) and
    under a tighter (half), a looser (double) and a TPOT-only one (`goodput`, by label). A relative
    SLO is resolved against the first policy's lowest-load point. -> the SLOs used."""
    base = min(
        (p for p in points if p["policy"] == points[0]["policy"]),
        key=load_of,
        default=None,
    )
    if base is None:
        return {}
    resolved = slo.resolve(base["ttft_p50_s"], base["tpot_p50_s"])
    grid = {
        "default": resolved,
        "tight": SLO(resolved.ttft_s / 2, resolved.tpot_s / 2),
        "loose": SLO(resolved.ttft_s * 2, resolved.tpot_s * 2),
        # past the knee a closed loop queues every policy's requests alike, and TTFT fails
        # for all: the streaming half of the SLO alone separates what the policy controls
        "tpot-only": SLO(float("inf"), resolved.tpot_s),
    }
    for p in points:
        p["goodput"] = {}
        for name, s in grid.items():
            req_s, tok_s = goodput(p["requests"], s, p["elapsed_s"])
            p["goodput"][name] = {"req_s": req_s, "tok_s": tok_s}
        p["goodput_req_s"] = p["goodput"]["default"]["req_s"]
        p["goodput_tok_s"] = p["goodput"]["default"]["tok_s"]
    return {
        "asked": slo.to_dict(),
        "unloaded_from": {
            "policy": base["policy"],
            "concurrency": base["concurrency"],
            "rate": base.get("rate"),
        },
        **{name: s.to_dict() for name, s in grid.items()},
    }


def analyze(points: list[dict]) -> dict:
    """Per policy: peak throughput and the load (concurrency, or arrival rate) where it
    happens (the knee), the worst throughput past the knee as a fraction of the peak,
    recomputed / generated tokens, and TPOT p99 at each load against its own unloaded
    (lowest-load) value."""
    out = {}
    for policy in dict.fromkeys(p["policy"] for p in points):
        mine = sorted((p for p in points if p["policy"] == policy), key=load_of)
        peak = max(mine, key=lambda p: p["throughput_tok_s"])
        past = [p for p in mine if load_of(p) > load_of(peak)]
        generated = sum(p["generated_tokens"] for p in mine)
        unloaded_tpot = mine[0]["tpot_p99_s"]
        out[policy] = {
            "peak_tok_s": peak["throughput_tok_s"],
            "knee_concurrency": peak["concurrency"],
            "knee_rate": peak.get("rate"),
            "worst_past_knee_fraction": (
                min(p["throughput_tok_s"] for p in past) / peak["throughput_tok_s"]
                if past and peak["throughput_tok_s"]
                else None
            ),
            "recomputed_fraction": (
                sum(p["recomputed_tokens"] for p in mine) / generated if generated else None
            ),
            "throughput_by_load": {load_of(p): p["throughput_tok_s"] for p in mine},
            "tpot_p99_vs_unloaded": {
                load_of(p): p["tpot_p99_s"] / unloaded_tpot if unloaded_tpot else None for p in mine
            },
        }
    return out


def load_label(point: dict) -> str:
    """`16` (closed-loop clients) or `0.25/s` (open-loop arrivals)."""
    rate = point.get("rate")
    return f"{rate:g}/s" if rate is not None else str(point["concurrency"])


def format_table(report: dict) -> str:
    slo = report.get("slo", {}).get("default")
    kind = report["workload"]["kind"]
    # only the synthetic workloads scale their outputs to the pool; a trace keeps its own
    lengths = (
        f" (mean output {report['workload']['mean_output']} tokens)"
        if kind in ("reasoning", "long-prompt")
        else ""
    )
    lines = [
        f"capacity sweep: {report['model']}, {report['cluster']['prefill']}P"
        f"{report['cluster']['decode']}D, {report['cluster']['num_kv_blocks']} KV blocks of "
        f"{report['cluster']['block_size']} tokens per decode worker, {kind} workload"
        f"{lengths}; `default` is {report.get('default_policy', '?')}",
        f"{'policy':<24} {'load':>6} {'tok/s':>7} {'good r/s':>8} {'TPOT-ok':>7} "
        f"{'TTFT p50':>8} {'p99':>7} "
        f"{'TPOT p50':>8} {'p99':>7} {'e2e p50':>7} {'p99':>7} {'preempt':>7} {'recomp':>7} "
        f"{'spill MiB':>9} {'moved':>5} {'err':>3}",
    ]
    for p in report["points"]:
        lines.append(
            f"{p['policy']:<24} {load_label(p):>6} {p['throughput_tok_s']:>7.1f} "
            f"{p.get('goodput_req_s', float('nan')):>8.2f} "
            f"{p.get('goodput', {}).get('tpot-only', {}).get('req_s', float('nan')):>7.2f} "
            f"{p['ttft_p50_s']:>8.2f} {p['ttft_p99_s']:>7.2f} {p['tpot_p50_s'] * 1e3:>6.0f}ms "
            f"{p['tpot_p99_s'] * 1e3:>5.0f}ms {p['e2e_p50_s']:>7.1f} {p['e2e_p99_s']:>7.1f} "
            f"{p['preemptions']:>7.0f} {p['recomputed_tokens']:>7.0f} "
            f"{p['spilled_bytes'] / 2**20:>9.1f} {p.get('migrations', 0):>5.0f} {p['errors']:>3}"
        )
    lines.append("")
    if slo:
        lines.append(
            f"SLO goodput (good r/s): TTFT <= {slo['ttft_s']:.2f} s and TPOT <= "
            f"{slo['tpot_s'] * 1e3:.0f} ms ({report['slo']['asked']}); TPOT-ok: the TPOT "
            f"target alone"
        )
    for policy, a in report["analysis"].items():
        worst = a["worst_past_knee_fraction"]
        lines.append(
            f"{policy}: peak {a['peak_tok_s']:.1f} tok/s at "
            f"{load_label({'concurrency': a['knee_concurrency'], 'rate': a.get('knee_rate')})}; "
            f"worst past the knee {'-' if worst is None else f'{worst:.0%} of peak'}; "
            f"recomputed {a['recomputed_fraction']:.1%} of generated tokens"
        )
    return "\n".join(lines)
