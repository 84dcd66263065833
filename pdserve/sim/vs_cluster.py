"""The cluster half of `bench sim-vs-real`: a real launched cluster (1P1D, or 1P2D with
`--decode-workers 2`) against the simulator's same disaggregated topology, on the same
workload, pool and policies (the pool per decode worker).

The real points are `bench sweep`'s (pdserve/bench/sweep.py run_point: closed-loop gRPC
clients, the decode worker's Prometheus counters before and after); the simulated ones use
the profile's cluster costs (`pdserve sim calibrate --cluster`)."""

from __future__ import annotations

from pdserve.bench.sweep import COUNTERS, run_point, scrape, wait_drained
from pdserve.bench.workload import Workload, prompts_for
from pdserve.engine.args import EngineArgs
from pdserve.sim.run import Setup, Topology, policy_args, simulate
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


def cluster_points(cmp: Comparison) -> list[dict]:
    from pdserve.launch import Cluster

    check_cluster_costs(cmp)
    config = model_config(cmp.model)
    base = EngineArgs(num_kv_blocks=cmp.num_kv_blocks, spill_dir=cmp.spill_dir)
    points = []
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
            if (cluster.lease_dir is not None) != cmp.profile.shares_cpus:
                raise ValueError(
                    f"profile {cmp.profile.name}: shares_cpus is {cmp.profile.shares_cpus} but "
                    f"this machine's cluster {'does' if cluster.lease_dir else 'does not'} take "
                    "turns at the CPUs: calibrate again (pdserve sim calibrate --cluster)"
                )
            metrics = [a for k, a in cluster.metrics.items() if k.startswith("decode")]
            for c in cmp.concurrencies:
                specs = cmp.specs(c)
                prompts = prompts_for(specs, config.vocab_size, cmp.seed)
                work = Workload(prompts, [s.output_tokens for s in specs])
                before = scrape(metrics)
                real = run_point(cluster.address, work, c, cmp.seed)
                after = scrape(metrics)
                wait_drained(cluster, metrics)
                real.update({k: after[k] - before[k] for k in COUNTERS})
                topology = Topology(prefill=1, decode=cmp.decode_workers)
                setup = Setup(config, cmp.profile, topology, args, seed=cmp.seed)
                # the cluster's costs are never rescaled: simulated once
                sim = simulate(setup, policy, specs, c, label=f"sim cluster {policy} c={c}")
                points.append(cmp.point("cluster", policy, c, real, (sim, None)))
    return points
