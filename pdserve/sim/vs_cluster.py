"""The cluster half of `bench sim-vs-real`: a real launched 1P1D cluster against the
simulator's disaggregated topology, on the same workload, pool and policies.

The real points are `bench sweep`'s (pdserve/bench/sweep.py run_point: closed-loop gRPC
clients, the decode worker's Prometheus counters before and after); the simulated ones use
the profile's cluster costs (`pdserve sim calibrate --cluster`)."""

from __future__ import annotations

from pdserve.bench.sweep import COUNTERS, run_point, scrape, wait_drained
from pdserve.bench.workload import Workload, prompts_for, specs_of
from pdserve.engine.args import EngineArgs
from pdserve.sim.profile import Profile
from pdserve.sim.run import Setup, Topology, policy_args, simulate
from pdserve.sim.vs_real import compare
from pdserve.weights import model_config


def cluster_points(
    model: str,
    profile: Profile,
    policies,
    concurrencies,
    num_kv_blocks: int,
    requests: int,
    mean_output: int,
    max_output: int,
    seed: int,
    spill_dir: str,
) -> list[dict]:
    from pdserve.launch import Cluster

    if not profile.cluster:
        raise ValueError(
            f"profile {profile.name}: no cluster costs; run pdserve sim calibrate --cluster"
        )
    config = model_config(model)
    base = EngineArgs(num_kv_blocks=num_kv_blocks, spill_dir=spill_dir)
    points = []
    for policy in policies:
        admission, args = policy_args(base, policy)
        decode_args = ["--admission", admission, "--preemption", args.preemption]
        decode_args += ["--spill-dir", spill_dir]
        with Cluster(
            model,
            1,
            1,
            worker_args=["--num-kv-blocks", str(num_kv_blocks), "--block-size", "16"],
            router_args=["--queue-timeout", "3600", "--max-queue", "4096"],
            decode_args=decode_args,
        ) as cluster:
            metrics = [a for k, a in cluster.metrics.items() if k.startswith("decode")]
            for c in concurrencies:
                specs = specs_of("reasoning", max(requests, c), seed + c, mean_output, max_output)
                prompts = prompts_for(specs, config.vocab_size, seed)
                work = Workload(prompts, [s.output_tokens for s in specs])
                before = scrape(metrics)
                real = run_point(cluster.address, work, c, seed)
                after = scrape(metrics)
                wait_drained(cluster, metrics)
                real.update({k: after[k] - before[k] for k in COUNTERS})
                setup = Setup(config, profile, Topology(prefill=1, decode=1), args, seed=seed)
                sim = simulate(setup, policy, specs, c, label=f"sim cluster {policy} c={c}")
                sim.pop("series")
                points.append(
                    {
                        "kind": "cluster",
                        "policy": policy,
                        "concurrency": c,
                        "real": real,
                        "sim": sim,
                        **compare(sim, real, counts=True),
                    }
                )
    return points
