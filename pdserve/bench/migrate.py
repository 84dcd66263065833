"""`pdserve bench migrate`: what a live migration costs a stream, on a launched 1P2D cluster.

For each context length: a greedy stream of that many random prompt tokens runs on one of
the two decode workers; once the client has `before` tokens, the worker is drained (its
stream moves to the other one, pdserve/router/migrate.py), then given requests again. The
client timestamps every token as it arrives. A point reports, per stream:

    median_gap_ms   the median gap between two tokens, the switch's left out
    stall_ms        the largest gap from the drain to the end: the switch as the client saw it
    stall_ratio     stall / median gap (the issue's bound: at most 3)
    rounds, bytes   the move's pre-copy rounds and KV bytes (the source worker's metrics)
    source_stall_ms the request stopped on the source -> its last WRITE complete
    equal           the tokens equal the unmoved runs of the same prompt
    cold            one of the cluster's first `cold` moves, which also connect the two
                    workers' transfer agents (shown apart: a cluster makes them once)

Before each measured stream, two unmoved runs of its prompt go at once (one on each decode
worker: both have run that context, nothing is cold when the move lands); their tokens are
the reference. Streams run one at a time (nothing else shares the workers), `repeats`
times per context.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from pdserve.bench.probes import registered
from pdserve.bench.prometheus import scrape, total
from pdserve.bench.report import machine_info
from pdserve.client import Client
from pdserve.launch import Cluster
from pdserve.progress import progress
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving import auth
from pdserve.weights import resolve

_SOURCE_METRICS = (
    ("rounds", "pdserve_decode_migration_rounds_sum"),
    ("bytes", "pdserve_decode_migrated_bytes_total"),
    ("source_stall_s", "pdserve_decode_migration_stall_seconds_sum"),
    ("moves", "pdserve_decode_migrations_total"),
)


def _decode_totals(cluster: Cluster) -> dict[str, dict[str, float]]:
    out = {}
    for wid, name in registered(cluster).items():
        if name.startswith("decode"):
            text = scrape(cluster.metrics[name])
            out[wid] = {key: total(text, metric) for key, metric in _SOURCE_METRICS}
            out[wid]["running"] = total(text, "pdserve_decode_running")
    return out


def _drain(cluster: Cluster, worker_id: str, undo: bool = False) -> list[pb.DrainProgress]:
    with auth.channel(cluster.address, cluster.security) as channel:
        stub = rpc.RouterStub(channel)
        return list(stub.Drain(pb.DrainRequest(worker_id=worker_id, undo=undo), timeout=300))


def _unmoved(client: Client, prompt: list[int], params: dict) -> list[int]:
    """Two unmoved runs of the prompt at once (the router spreads them over both decode
    workers: each has run this context before the measured stream) -> their tokens."""
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: client.generate(prompt, **params).token_ids, range(2)))
    assert runs[0] == runs[1], "two greedy runs of one prompt differ"
    return runs[0]


_ENDED_FIRST = (
    "after: the stream ended before its move ({after} tokens after the first {before} took "
    "less than starting a drain; a fast model); give --after more tokens"
)


def _one(cluster: Cluster, client: Client, prompt: list[int], before: int, after: int) -> dict:
    """One moved stream, after its unmoved twins -> the point's row."""
    params = dict(max_tokens=before + after, temperature=0, ignore_eos=True)
    twin = _unmoved(client, prompt, params)
    tokens: list[int] = []
    arrivals: list[float] = []
    moved_at = None
    final = None
    source = None
    mover = ThreadPoolExecutor(1)  # the stream is read on while the drain runs

    def move(source: str) -> list[pb.DrainProgress]:
        try:
            return _drain(cluster, source)
        finally:
            _drain(cluster, source, undo=True)

    for msg in client.messages(prompt, timeout_s=600, **params):
        now = time.perf_counter()
        for token in msg.token_ids:
            tokens.append(token)
            arrivals.append(now)
        if msg.finished:
            final = msg
        if moved_at is None and len(tokens) >= before:
            counts = _decode_totals(cluster)
            source = next((w for w, c in counts.items() if c["running"] > 0), None)
            if source is None:  # a fast model: it decoded the rest before we looked
                raise ValueError(_ENDED_FIRST.format(after=after, before=before))
            start_counts = counts[source]
            moved_at = len(tokens)
            drained = mover.submit(move, source)
    assert final is not None and source is not None
    progress_msgs = drained.result(timeout=300)
    if not final.timings.migrations:  # it ended while the drain started: nothing moved
        raise ValueError(_ENDED_FIRST.format(after=after, before=before))
    mover.shutdown()
    end_counts = _decode_totals(cluster)[source]
    delta = {k: end_counts[k] - start_counts[k] for k, _ in _SOURCE_METRICS}
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    # the switch: the largest gap from the drain on (its tokens arrived after moved_at)
    switch = max(range(moved_at - 1, len(gaps)), key=gaps.__getitem__)
    steady = [g for i, g in enumerate(gaps) if i != switch]
    median = statistics.median(steady)
    return {
        "tokens": len(tokens),
        "migrations": final.timings.migrations,
        "resumes": final.timings.resumes,
        "moved": progress_msgs[-1].moved,
        "median_gap_ms": 1e3 * median,
        "stall_ms": 1e3 * gaps[switch],
        "stall_ratio": gaps[switch] / median,
        "equal": tokens == twin,
        **_per_move(delta),
    }


def bench_migrate(
    model: str = "smollm2-135m",
    contexts: list[int] = (256, 1024, 2048),
    before: int = 32,
    after: int = 32,
    repeats: int = 2,
    seed: int = 0,
    cold: int = 2,
    decode_tp: int = 1,
    share_cpus: bool | None = None,
    router_idle: bool | None = None,
) -> dict:
    """`decode_tp`: each decode worker a tensor-parallel group of that many ranks (every
    rank moves its own KV heads)."""
    if decode_tp < 1:
        raise ValueError(f"decode_tp: must be >= 1, got {decode_tp}")
    g = torch.Generator().manual_seed(seed)
    blocks = 2 * (-(-(max(contexts) + before + after + 256) // 16)) + 64
    worker_args = ["--num-kv-blocks", str(blocks)]
    points = []
    with (
        Cluster(
            model,
            1,
            2,
            worker_args=worker_args,
            decode_tp=decode_tp,
            share_cpus=share_cpus,
            router_idle=router_idle,
        ) as c,
        Client(c.address, security=c.security) as client,
        progress(total=cold + len(contexts) * repeats, desc="bench migrate") as bar,
    ):
        cpus = c.cpus()
        # any ids the model knows (SmolLM2's vocabulary is 49,152; a test model's 384)
        vocab = min(4096, resolve(model).config.vocab_size)
        client.generate([5, 6, 7], max_tokens=4, temperature=0)  # warm both roles up
        # the first moves between two workers also make their transfer connections (each
        # way): measured and shown, but apart ("cold"); a cluster makes them once
        for context in [contexts[0]] * cold + [x for x in contexts for _ in range(repeats)]:
            prompt = torch.randint(3, vocab, (context,), generator=g).tolist()
            row = _one(c, client, prompt, before, after)
            points.append({"context": context, "cold": len(points) < cold, **row})
            bar.update(1)
    return {
        "benchmark": "migrate",
        "model": model,
        "topology": "1P2D launched on 127.0.0.1 (NIXL over UCX)"
        + (f", decode TP={decode_tp}" if decode_tp > 1 else ""),
        "decode_tp": decode_tp,
        "cpus": cpus,
        "before": before,
        "after": after,
        "repeats": repeats,
        "points": points,
        "machine": machine_info(),
    }


def _per_move(totals: dict[str, float]) -> dict:
    moves = max(1.0, totals.get("moves", 0.0))
    return {
        "rounds_per_move": totals.get("rounds", 0.0) / moves,
        "mib_per_move": totals.get("bytes", 0.0) / moves / 2**20,
        "source_stall_ms": 1e3 * totals.get("source_stall_s", 0.0) / moves,
    }


def format_table(report: dict) -> str:
    head = "context | cold | moved | equal | median gap ms | stall ms | stall/median | rounds | MiB"
    lines = [head]
    for p in report["points"]:
        lines.append(
            f"{p['context']} | {'cold' if p['cold'] else ''} | {p['migrations']} | {p['equal']} | "
            f"{p['median_gap_ms']:.1f} | "
            f"{p['stall_ms']:.1f} | {p['stall_ratio']:.2f} | {p['rounds_per_move']:.1f} | "
            f"{p['mib_per_move']:.1f}"
        )
    lines.append(f"{report['model']}, {report['topology']}; the issue's bound: stall/median <= 3")
    return "\n".join(lines)
