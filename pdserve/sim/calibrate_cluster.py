"""`pdserve sim calibrate --cluster`: a launched 1P1D cluster's costs, read off its traces.

A real cluster (router, one prefill and one decode worker process, NIXL) serves closed loops
of 1-16 clients; every request comes back with its trace (pdserve/trace.py), from which:

    cluster          decode steps: `decode.step` spans shared by the requests of one step
                     (their count, and each one's context: its prompt plus the tokens before
                     that step); a step's cost is its cycle, start to the next step's start
                     when the worker ran back to back; fitted as the engine is
    cluster_decodes  the same decode steps on a launched 1P2D cluster (more decode workers:
                     `decodes`), its clients doubled: the decode workers split the CPUs
                     there (one thread each on 2 CPUs, stepping side by side), so a step
                     costs more than a lone decode worker's on every CPU
    cluster_prefill  prefill batches: the `prefill.compute` span of a batch and its prompts
                     (the pass itself, inside its turn at the CPUs; batches are not cut by
                     time here, `--turn-s 0`)
    link             the push: `transfer.tail` against the bytes each batch pushed
    handoff          medians of the router's calls: `decode.reserve`, `rpc.prefill` plus
                     `rpc.prefill_reply`, `rpc.start`, and `router.stream` per request
    shares_cpus      whether its workers took turns at the CPUs (launch's default on CPU):
                     the simulated cluster then does too (pdserve/sim/cluster.py)
"""

from __future__ import annotations

import asyncio
import statistics
from collections import defaultdict

import numpy as np

from pdserve.bench.serve import _drive
from pdserve.bench.workload import RequestSpec, Workload, prompts_for
from pdserve.engine.args import EngineArgs
from pdserve.kv.kv_cache import bytes_per_block
from pdserve.progress import progress
from pdserve.sim.cost import StepWork
from pdserve.sim.fit import fit_steps
from pdserve.weights import model_config

DECODES = (1, 2)  # the clusters measured by default: 1P1D, 1P2D
LOADS = ((1, 48, 64), (2, 32, 64), (4, 32, 64), (8, 32, 48), (16, 32, 48), (4, 512, 16))


def _steps(traces: list[dict]) -> tuple[list, list]:
    """-> (decode step samples, prefill batch samples) as (StepWork, seconds)."""
    steps = defaultdict(list)  # (worker, start, end) -> [context of each request]
    batches = defaultdict(list)  # (worker, start, end) -> [prompt tokens]
    for t in traces:
        spans = sorted(t["spans"], key=lambda s: s["start"])
        k = 0
        for s in spans:
            key = (s["worker"], round(s["start"], 6), round(s["end"], 6))
            if s["name"] == "decode.step":
                steps[key].append(t["prompt_tokens"] + 1 + k)
                k += 1
            elif s["name"] == "prefill.compute":
                batches[key].append(t["prompt_tokens"])
    decode = []
    by_worker = defaultdict(list)
    for (worker, start, end), contexts in steps.items():
        by_worker[worker].append((start, end, contexts))
    for rows in by_worker.values():
        rows.sort()
        for (start, end, contexts), nxt in zip(rows, rows[1:] + [None]):
            run = end - start
            cycle = nxt[0] - start if nxt is not None else run
            seconds = cycle if cycle < 2 * run + 0.02 else run  # back to back, else its own
            work = StepWork(len(contexts), len(contexts), sum(contexts), 0, 0.0, len(contexts), 0)
            decode.append((work, seconds))
    prefill = []
    for (_, start, end), prompts in batches.items():
        attention = float(sum(p * (p + 1) / 2 for p in prompts))
        tokens = sum(prompts)
        work = StepWork(
            len(prompts),
            tokens,
            0,
            tokens,
            attention,
            len(prompts),
            tokens,
            prefill_seqs=len(prompts),
        )
        prefill.append((work, end - start))
    return decode, prefill


def _median_span(traces: list[dict], *names: str) -> float:
    per_request = [
        sum(s["end"] - s["start"] for s in t["spans"] if s["name"] in names) for t in traces
    ]
    return statistics.median(per_request) if per_request else 0.0


def _traces(model: str, decodes: int, num_kv_blocks: int, seed: int) -> tuple[list, bool]:
    """Serve LOADS (the clients times `decodes`: each decode worker sees the batches a lone
    one does) on a launched 1P`decodes`D cluster -> (every request's trace, whether its
    workers took turns at the CPUs)."""
    from pdserve.launch import Cluster

    config = model_config(model)
    with Cluster(
        model,
        1,
        decodes,
        worker_args=["--num-kv-blocks", str(num_kv_blocks), "--block-size", "16"],
        # whole batches as the budget forms them, however long their turn: what a batch
        # costs is fitted here, how turns cut them is the simulator's (prefill/turns.py)
        prefill_args=["--turn-s", "0"],
    ) as cluster:
        shares_cpus = cluster.lease_dir is not None  # its workers took turns at the CPUs
        loads = progress(LOADS, desc=f"calibrate cluster 1P{decodes}D", unit="load")
        traces = serve_loads(cluster.address, config.vocab_size, loads, decodes, seed)
    return traces, shares_cpus


def serve_loads(address: str, vocab_size: int, loads, decodes: int, seed: int) -> list[dict]:
    """Each (clients, prompt tokens, output tokens) of `loads` served to its end on the
    cluster at `address`, its clients times `decodes` (each decode worker sees the batches a
    lone one does), two requests a client -> every completed request's trace."""
    traces: list[dict] = []
    for i, (clients, prompt, output) in enumerate(loads):
        clients *= decodes
        specs = [RequestSpec(0.0, prompt, output)] * (2 * clients)
        work = Workload(prompts_for(specs, vocab_size, seed + i), [output] * len(specs))
        samples, _ = asyncio.run(_drive(address, work, clients, None, seed))
        for s in samples:
            if s.error is None and s.trace is not None:
                traces.append({**s.trace, "prompt_tokens": s.prompt_tokens})
    return traces


def check_decodes(decodes: tuple[int, ...]) -> None:
    """ValueError unless `decodes` names 1 and any larger counts of decode workers."""
    if 1 not in decodes or any(n < 1 for n in decodes):
        raise ValueError(
            f"cluster decodes: 1 and any larger counts of decode workers, got "
            f"{','.join(map(str, decodes))}"
        )


def calibrate_cluster(
    model: str, num_kv_blocks: int = 256, seed: int = 0, decodes: tuple[int, ...] = DECODES
) -> dict:
    """The cluster parts of a profile, from a launched 1P1D cluster and, on a CPU node, for
    each other count in `decodes`, a 1PnD one: its decode steps alone (`cluster_decodes`,
    where the decode workers split the CPUs and their steps cost more)."""
    from pdserve.launch import computes_on_cpu

    check_decodes(decodes)
    config = model_config(model)
    traces, shares_cpus = _traces(model, 1, num_kv_blocks, seed)
    more, more_fit = {}, {}
    # on a GPU node each decode worker of a real deployment has its own GPU: two sharing
    # the one measured here would not say what a step costs there
    for n in sorted(set(decodes) - {1}) if computes_on_cpu([]) else ():
        steps, _ = _steps(_traces(model, n, num_kv_blocks, seed)[0])
        more[str(n)], more_fit[f"cluster_{n}d"] = fit_steps(steps)
    decode, prefill = _steps(traces)
    decode_coef, decode_fit = fit_steps(decode)
    prefill_coef, prefill_fit = fit_steps(prefill)
    defaults = EngineArgs()  # what `pdserve launch` workers run: fp32 on CPU, bf16 on CUDA
    block = bytes_per_block(config, 16, defaults.resolve_dtype(defaults.resolve_device()))
    tails = []
    for t in traces:
        tail = sum(s["end"] - s["start"] for s in t["spans"] if s["name"] == "transfer.tail")
        blocks = -(-t["prompt_tokens"] // 16)
        tails.append((blocks * block, tail))
    x = np.array([[1.0, b] for b, _ in tails])
    y = np.array([t for _, t in tails])
    (latency, per_byte), *_ = np.linalg.lstsq(x, y, rcond=None)
    return {
        "cluster": decode_coef,
        "cluster_decodes": more,
        "cluster_prefill": prefill_coef,
        "link": {
            "bytes_s": 1.0 / per_byte if per_byte > 0 else float(np.sum(x[:, 1]) / np.sum(y)),
            "latency_s": max(0.0, float(latency)),
        },
        "handoff": {
            "reserve_s": _median_span(traces, "decode.reserve"),
            "prefill_rpc_s": _median_span(traces, "rpc.prefill", "rpc.prefill_reply"),
            "start_s": _median_span(traces, "rpc.start"),
            "per_token_s": _median_span(traces, "router.stream"),
        },
        "fit": {"cluster": decode_fit, **more_fit, "cluster_prefill": prefill_fit},
        "shares_cpus": shares_cpus,
    }
