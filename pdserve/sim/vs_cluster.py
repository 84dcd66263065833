"""The cluster half of `bench sim-vs-real`: a real launched cluster (1P1D, or 1P2D with
`--decode-workers 2`) against the simulator's same disaggregated topology, on the same
workload, pool and policies (the pool per decode worker).

The real points are `bench sweep`'s (pdserve/bench/sweep.py run_point: closed-loop gRPC
clients, the decode worker's Prometheus counters before and after); the simulated ones use
the profile's cluster costs (`pdserve sim calibrate --cluster`).

Each launched cluster is probed before its points (`cluster_drift`): three short loads
(batches of 1 to 12 per decode worker when the router spreads them), their decode steps
and prefill batches read off the traces as the calibration reads them, measured over the
profile's predicted time. With `--rescale` that cluster's points are simulated with its
prefill batches scaled by the prefill factor and its decode steps by two (what a step
costs whatever its batch, and per sequence), and with the profile as given, beside them."""

from __future__ import annotations

from pdserve.bench.sweep import COUNTERS, run_point, scrape, wait_drained
from pdserve.bench.workload import Workload, prompts_for
from pdserve.engine.args import EngineArgs
from pdserve.sim.calibrate_cluster import _steps, serve_loads
from pdserve.sim.fit import measured_over, split_over
from pdserve.sim.profile import Profile
from pdserve.sim.run import Setup, Topology, policy_args
from pdserve.sim.vs_real import Comparison
from pdserve.weights import model_config


def check_cluster_costs(cmp: Comparison) -> None:
    """ValueError unless the profile has the cluster costs this comparison simulates."""
    if not cmp.profile.cluster:
        raise ValueError(
            f"profile {cmp.profile.name}: no cluster costs; run pdserve sim calibrate --cluster"
        )
    n = cmp.decode_workers
    if n > 1 and str(n) not in cmp.profile.cluster_decodes:
        raise ValueError(
            f"profile {cmp.profile.name}: no decode steps measured with {n} decode workers "
            f"(cluster_decodes); its 1P1D steps would be compared with a 1P{n}D cluster's: "
            f"run pdserve sim calibrate --cluster --cluster-decodes 1,{n}"
        )


# (clients per decode worker, prompt tokens, output tokens): two of the calibration's loads
# (calibrate_cluster.LOADS), and BATCHES, batches of up to 12 requests of one block each
# (the comparison's loaded points run batches of 8-16, and the machine's speed-up since a
# calibration was not the same at those as at 1-4: docs/simulator.md), for the decode
# steps only (4-token prompts are off the calibration's prefill grid). Each load's requests
# fit PROBE_BLOCKS blocks per decode worker at once when the router spreads them evenly;
# it does not always (a 1P2D's probe of 2 x 12 clients saw a batch of 24 on one worker:
# BATCHES still fits 32 blocks then, PROBE's second load not), and a preempted request's
# recompute or reload runs inside decode steps the probe reads as pure decode, so
# cluster_points records the preemptions made while the probe ran and the report names them
PROBE = ((1, 48, 64), (4, 32, 64))
BATCHES = ((12, 4, 12),)
PROBE_BLOCKS = max(c * -(-(prompt + output) // 16) for c, prompt, output in PROBE + BATCHES)
MIN_PREFILLS = 3  # prefill batches a probe needs before its prefill factor is used


def check_cluster_probe(cmp: Comparison) -> None:
    """ValueError when --rescale needs a probe this comparison's pool cannot hold."""
    if cmp.rescale and cmp.num_kv_blocks < PROBE_BLOCKS:
        raise ValueError(
            f"rescale: each cluster's probe needs {PROBE_BLOCKS} blocks per decode worker "
            f"(no preemption while it measures), the pool has {cmp.num_kv_blocks}"
        )


def cluster_drift(address: str, cmp: Comparison, profile: Profile) -> dict:
    """How fast this launched cluster runs now against `profile`: PROBE served on it (about
    25 s) -> for its decode steps and its prefill batches, the median of measured over the
    profile's predicted time (the coefficients the simulated cluster uses: pdserve/sim/run.py
    Setup.cost), the decode steps' `split` (pdserve/sim/fit.py split_over: one factor for
    what a step costs whatever its batch, one for its terms per sequence; None where the
    steps cannot tell them apart), and `factors`, what --rescale applies: the split's two
    (`decode`, `decode_per_seq`), else the decode median alone, and the prefill one when the
    probe saw MIN_PREFILLS batches (else 1.0, prefill as given). The engine's probe
    does not say this: on this machine a cluster's speed did not move with the engine's
    (docs/simulator.md). A pool too small for the probe, or a probe that saw no decode
    step, gives no figures (`skipped` says why)."""
    if cmp.num_kv_blocks < PROBE_BLOCKS:
        return {"skipped": f"pool of {cmp.num_kv_blocks} blocks < {PROBE_BLOCKS} the probe needs"}
    config = model_config(cmp.model)
    traces = serve_loads(address, config.vocab_size, PROBE, cmp.decode_workers, cmp.seed + 7919)
    batched = serve_loads(address, config.vocab_size, BATCHES, cmp.decode_workers, cmp.seed + 1)
    decode, prefill = _steps(traces)
    decode = decode + _steps(batched)[0]
    steps = profile.cluster_decode(cmp.decode_workers)
    drift = {
        "decode": measured_over(decode, steps),
        "prefill": measured_over(prefill, profile.cluster_prefill or profile.engine),
    }
    if drift["decode"] is None:
        seen = len(traces) + len(batched)
        return {**drift, "skipped": f"no decode step came back from {seen} traces"}
    used = drift["prefill"] is not None and drift["prefill"]["steps"] >= MIN_PREFILLS
    drift["decode"]["used"] = True
    if drift["prefill"] is not None:
        drift["prefill"]["used"] = used
    split = drift["split"] = split_over(decode, steps)
    if split is None:
        factors = {"decode": drift["decode"]["measured_over_profile"]}
    else:
        factors = {"decode": split["base"], "decode_per_seq": split["per_seq"]}
    prefill_factor = drift["prefill"]["measured_over_profile"] if used else 1.0
    drift["factors"] = {**factors, "prefill": prefill_factor}
    return drift


def cluster_points(cmp: Comparison) -> tuple[list[dict], list[dict]]:
    """-> (the cluster's points, each launched cluster's probe)."""
    from pdserve.launch import Cluster

    check_cluster_costs(cmp)
    config = model_config(cmp.model)
    base = EngineArgs(num_kv_blocks=cmp.num_kv_blocks, spill_dir=cmp.spill_dir)
    given = cmp.profile  # the cluster's costs as measured
    points, drifts = [], []
    for policy in cmp.policies:
        admission, args = policy_args(base, policy)
        decode_args = ["--admission", admission, "--preemption", args.preemption]
        decode_args += ["--spill-dir", cmp.spill_dir]
        with Cluster(
            cmp.model,
            1,
            cmp.decode_workers,
            worker_args=["--num-kv-blocks", str(cmp.num_kv_blocks), "--block-size", "16"],
            router_args=["--queue-timeout", "3600", "--max-queue", "4096"],
            decode_args=decode_args,
        ) as cluster:
            if (cluster.lease_dir is not None) != given.shares_cpus:
                raise ValueError(
                    f"profile {given.name}: shares_cpus is {given.shares_cpus} but "
                    f"this machine's cluster {'does' if cluster.lease_dir else 'does not'} take "
                    "turns at the CPUs: calibrate again (pdserve sim calibrate --cluster)"
                )
            metrics = [a for k, a in cluster.metrics.items() if k.startswith("decode")]
            probed = scrape(metrics)
            drift = cluster_drift(cluster.address, cmp, given)
            wait_drained(cluster, metrics)
            preempted = scrape(metrics)["preemptions"] - probed["preemptions"]
            drifts.append({"policy": policy, **drift, "preemptions": preempted})
            profile = given
            if cmp.rescale:
                if "factors" not in drift:
                    raise RuntimeError(f"rescale: the cluster's probe: {drift['skipped']}")
                profile = given.cluster_scaled(cmp.decode_workers, **drift["factors"])
            runs: dict[int, list[dict]] = {c: [] for c in cmp.concurrencies}
            for round_ in range(cmp.repeat):  # --repeat: rounds of the loads in turn
                for c in cmp.concurrencies:
                    specs = cmp.specs(c)
                    prompts = prompts_for(specs, config.vocab_size, cmp.prompt_seed(c, round_))
                    work = Workload(prompts, [s.output_tokens for s in specs])
                    before = scrape(metrics)
                    real = run_point(cluster.address, work, c, cmp.seed)
                    after = scrape(metrics)
                    wait_drained(cluster, metrics)
                    real.update({k: after[k] - before[k] for k in COUNTERS})
                    runs[c].append(real)
            for c, reals in runs.items():
                specs = cmp.specs(c)
                topology = Topology(prefill=1, decode=cmp.decode_workers)
                setup = Setup(config, profile, topology, args, seed=cmp.seed)
                sims = cmp.simulate(setup, policy, specs, c, f"sim cluster {policy} c={c}")
                points.append(cmp.point("cluster", policy, c, reals, sims))
    return points, drifts
