"""`pdserve bench parity`: a launched 1P1D cluster against the in-process engine, the same
requests, the same threads, in one run.

At each concurrency c, c greedy requests (prompts of 24-48 tokens, `max_tokens` outputs,
EOS ignored) are run twice: by `LLM.generate` in this process, as one batch, and through
the cluster's router as c concurrent streams (the SDK's AsyncClient.messages). Throughput
is output tokens over the wall time from the first request sent to the last token
received; the ratio is the cluster's over the engine's. Rounds interleave the two (engine
first, then cluster first, ...), so a noisy neighbour hits both; the report keeps every
round and the median ratio.

Threads: the engine runs with `threads` torch threads (default: every CPU) and so does the
cluster's decode worker; the prefill worker gets every CPU too when the workers share them
in turns (launch's default on CPU), or what pdserve.launch.worker_threads gives it (1 on 2
CPUs) with `share_cpus=False` (launch --no-share-cpus); the router and the client's event
loop run beside them, as they would on a node. The report records every count, as the
workers were started. The engine and the decode worker have the same KV pool
(`num_kv_blocks`, big enough that nothing is preempted) and block size.
Every cluster stream has a deadline (DEADLINE_S) and must end with its final message
(the SDK's StreamEnded otherwise).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time

import torch

from pdserve.bench.report import machine_info
from pdserve.progress import progress

CONCURRENCIES = (8, 16, 32)
DEADLINE_S = 600.0  # one cluster stream, start to end


def parity_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(24, 49))] for _ in range(n)]


def run_engine(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from pdserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


async def _streams(address: str, security, prompts: list[list[int]], max_tokens: int):
    """c concurrent requests through the SDK (StreamEnded if one ends without its final
    message, DEADLINE_EXCEEDED past DEADLINE_S) -> (seconds, tokens of each)."""
    from pdserve.client import AsyncClient

    client = AsyncClient(address, security=security)

    async def one(prompt: list[int]) -> list[int]:
        messages = client.messages(
            prompt, timeout_s=DEADLINE_S, max_tokens=max_tokens, temperature=0, ignore_eos=True
        )
        return [t async for msg in messages for t in msg.token_ids]

    try:
        # connected before the clock starts: the engine side has no connection to make
        await asyncio.wait_for(client.channel.channel_ready(), DEADLINE_S)
        start = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - start, list(outs)
    finally:
        await client.close()


def run_cluster(cluster, prompts: list[list[int]], max_tokens: int):
    return asyncio.run(_streams(cluster.address, cluster.security, prompts, max_tokens))


def bench_parity(
    model: str,
    concurrencies: tuple[int, ...] = CONCURRENCIES,
    max_tokens: int = 128,
    rounds: int = 2,
    threads: int | None = None,
    num_kv_blocks: int = 1024,
    seed: int = 0,
    share_cpus: bool | None = None,
    router_idle: bool | None = None,
) -> dict:
    from pdserve import LLM
    from pdserve.launch import Cluster
    from pdserve.weights import resolve

    threads = threads or os.cpu_count() or 1
    if threads < 1 or rounds < 1 or max_tokens < 1 or min(concurrencies, default=0) < 1:
        raise ValueError("threads, rounds, max_tokens and every concurrency must be >= 1")
    vocab = resolve(model).config.vocab_size
    # fresh prompts at every point: a prompt seen in an earlier round would be a prefix
    # cache hit (on one side more than the other), not the same work
    prompts = {
        (r, c): parity_prompts(c, vocab, seed + 1000 * r + c)
        for r in range(rounds)
        for c in concurrencies
    }
    warm = parity_prompts(2, vocab, seed - 1)
    torch.set_num_threads(threads)
    llm = LLM(model, num_kv_blocks=num_kv_blocks)
    run_engine(llm, warm, 4)  # warm-up: first-call allocations
    points = {c: [] for c in concurrencies}
    decode_args = ["--num-kv-blocks", str(num_kv_blocks)]
    with Cluster(
        model,
        1,
        1,
        decode_args=decode_args,
        decode_threads=threads,
        share_cpus=share_cpus,
        router_idle=router_idle,
    ) as cluster:
        started = cluster.threads()
        cpus = cluster.cpus()
        run_cluster(cluster, warm, 4)  # warm-up, as above
        steps = [(r, c) for r in range(rounds) for c in concurrencies]
        for r, c in progress(steps, desc="bench parity", unit="point"):
            order = ("engine", "cluster") if r % 2 == 0 else ("cluster", "engine")
            seconds, tokens = {}, {}
            for side in order:
                if side == "engine":
                    seconds[side], tokens[side] = run_engine(llm, prompts[r, c], max_tokens)
                else:
                    seconds[side], tokens[side] = run_cluster(cluster, prompts[r, c], max_tokens)
            made = {s: sum(len(t) for t in tokens[s]) for s in order}
            tok_s = {s: made[s] / seconds[s] for s in order}
            points[c].append(
                {
                    "round": r,
                    "order": list(order),
                    "seconds": seconds,
                    "output_tokens": made,
                    "tok_s": tok_s,
                    "ratio_cluster_over_engine": tok_s["cluster"] / tok_s["engine"],
                    # greedy and the same weights: a cluster that lost or repeated a token
                    # would not be the same work
                    "equal_outputs": tokens["cluster"] == tokens["engine"],
                }
            )
    return {
        "benchmark": "parity",
        "model": model,
        "max_tokens": max_tokens,
        "threads": {
            "engine": threads,
            "decode_worker": started["decode"],
            "prefill_worker": started["prefill"],
            "cpus": os.cpu_count(),
        },
        **cpus,
        "num_kv_blocks": num_kv_blocks,
        "rounds": rounds,
        "seed": seed,
        "machine": machine_info(),
        "points": [
            {
                "concurrency": c,
                "median_ratio": statistics.median(p["ratio_cluster_over_engine"] for p in runs),
                "engine_tok_s": [p["tok_s"]["engine"] for p in runs],
                "cluster_tok_s": [p["tok_s"]["cluster"] for p in runs],
                "all_equal": all(p["equal_outputs"] for p in runs),
                "runs": runs,
            }
            for c, runs in points.items()
        ],
    }


def format_table(report: dict) -> str:
    t = report["threads"]
    prefill = f", prefill worker {t['prefill_worker']}" if "prefill_worker" in t else ""
    turns = " (workers in turns: --share-cpus)" if report.get("share_cpus") else ""
    turns += " (router at idle priority)" if report.get("router_idle") else ""
    lines = [
        f"bench parity: {report['model']}, 1P1D cluster vs in-process engine, "
        f"{t['engine']} threads each{prefill}{turns}, {report['max_tokens']} output tokens",
        f"{'c':>4} {'engine tok/s':>18} {'cluster tok/s':>18} {'ratio':>6} {'equal':>6}",
    ]
    for p in report["points"]:
        eng = "/".join(f"{v:.1f}" for v in p["engine_tok_s"])
        clu = "/".join(f"{v:.1f}" for v in p["cluster_tok_s"])
        lines.append(
            f"{p['concurrency']:>4} {eng:>18} {clu:>18} {p['median_ratio']:>6.2f} "
            f"{str(p['all_equal']):>6}"
        )
    return "\n".join(lines)
