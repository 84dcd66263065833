"""`pdserve bench transfer`: the KV handoff against a raw NIXL WRITE of the same bytes, and
TTFT with layer-wise push against push-after-prefill.

Part 1 (same process, two NIXL agents, the model's real KV pool layout): for n blocks, the
handoff posts what the prefill worker posts (prefill/push.py write_layers: one
descriptor per plane and run of blocks consecutive on both sides, else prepared tiles):
every layer in one WRITE, and, for the allocator layout, also one WRITE per layer as the
layer-wise push does. The raw baseline writes the same number of bytes as one contiguous
descriptor. Block ids on each side come from three layouts: a fresh pool (consecutive ids),
the real allocator after churn (a pool twice the size filled with requests of random sizes,
half of them freed in random order, then the n blocks allocated as a new sequence) and a
random permutation (the worst case: no two blocks adjacent by design).
Throughput = bytes / (first post -> every transfer DONE), median of `reps` rounds; each
round times raw and every layout back to back, and a fraction of raw is the median over
rounds of the two times' ratio.

Part 2 (a real prefill worker and decode worker in this process): time from submitting a
prompt to the prefill result (KV in the decode blocks, first token known), with the KV pushed
layer by layer during the forward pass versus all layers after it.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from pdserve.bench.report import machine_info
from pdserve.engine.args import EngineArgs
from pdserve.kv import KVCache
from pdserve.kv.block_allocator import BlockAllocator
from pdserve.progress import progress
from pdserve.sampling_params import SamplingParams
from pdserve.serving.kv_pool import pool_geometry
from pdserve.weights import resolve
from transfer import Desc, make_agent
from transfer.writes import PoolSide, block_runs, write_layers

LAYOUTS = ("contiguous", "allocator", "scattered")


def _once(post) -> float:
    start = time.perf_counter()
    transfers = post()
    for t in transfers:
        t.wait(timeout_s=60)
    elapsed = time.perf_counter() - start
    for t in transfers:
        t.release()
    return elapsed


def _rounds(posts: dict, reps: int) -> dict[str, list[float]]:
    """Seconds per round for each candidate. Every round times all of them back to back (in
    an order that rotates), so that a fraction of raw compares runs made moments apart on a
    machine whose memory bandwidth drifts."""
    names = list(posts)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps + 1):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t = _once(posts[name])
            if r:  # round 0 warms up
                times[name].append(t)
    return times


def churned_ids(num_blocks: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Block ids the real allocator gives a new n-block sequence in a long-running pool."""
    alloc = BlockAllocator(num_blocks, 1, enable_prefix_caching=False)
    held = []
    while alloc.num_free_blocks > n:  # fill with requests of 1-32 blocks
        size = int(rng.integers(1, 33))
        if size > alloc.num_free_blocks - n:
            break
        held.append(alloc.allocate([0] * size).block_ids)
    for i in rng.permutation(len(held))[: len(held) // 2]:
        alloc.free(held[i])
    return np.array(alloc.allocate([0] * n).block_ids)


def _runs(ids: np.ndarray) -> int:
    """Number of runs of consecutive ids (1 = one contiguous range)."""
    return int(1 + np.count_nonzero(np.diff(ids) != 1)) if ids.size else 0


def handoff_vs_raw(model: str, counts: list[int], backend: str, reps: int) -> list[dict]:
    config = resolve(model).config
    blocks = 2 * max(counts)
    src_kv = KVCache(config, blocks, 16, torch.float32, torch.device("cpu"))
    dst_kv = KVCache(config, blocks, 16, torch.float32, torch.device("cpu"))
    src_kv.pool.normal_()
    geometry = pool_geometry(config, src_kv.pool, src_kv.block_dim)
    planes = geometry.planes_per_layer * config.num_layers
    src, dst = make_agent(backend, "bench-src"), make_agent(backend, "bench-dst")
    rows = []
    try:
        rs, rd = src.register(src_kv.pool), dst.register(dst_kv.pool)
        peer = src.add_peer(dst.metadata())
        local_tiles = src.prepare_tiles(None, rs, geometry.block_bytes)
        remote_tiles = src.prepare_tiles(peer, rd, geometry.block_bytes)
        gen = torch.Generator().manual_seed(0)
        rng = np.random.default_rng(0)
        for n in progress(counts, desc="bench transfer", unit="size"):
            nbytes = n * planes * geometry.block_bytes
            layouts = {
                # a fresh pool hands out consecutive blocks: NIXL merges adjacent tiles
                "contiguous": (np.arange(n), np.arange(n) + (blocks - n)),
                # the allocator after churn: runs where it found them
                "allocator": (churned_ids(blocks, n, rng), churned_ids(blocks, n, rng)),
                # a long-running pool's blocks are scattered: one descriptor per tile
                "scattered": (
                    torch.randperm(blocks, generator=gen)[:n].numpy(),
                    torch.randperm(blocks, generator=gen)[:n].numpy(),
                ),
            }

            def raw(nbytes=nbytes):
                return [src.write(peer, [Desc(rs, 0, nbytes)], [Desc(rd, 0, nbytes)], b"")]

            def handoff(ids_src, ids_dst, layerwise=False):
                # what the prefill worker posts: every layer in one WRITE (push after
                # prefill), or one WRITE per layer as each is computed (layer-wise)
                blocks = (ids_src, ids_dst, block_runs(ids_src, ids_dst))
                src_side = PoolSide(geometry, rs, local_tiles)
                dst_side = PoolSide(geometry, rd, remote_tiles)
                groups = (
                    [range(x, x + 1) for x in range(config.num_layers)]
                    if layerwise
                    else [range(config.num_layers)]
                )
                return [
                    write_layers(src, peer, g, src_side, dst_side, blocks, b"")[0] for g in groups
                ]

            posts = {"raw": raw}
            for name, ids in layouts.items():
                posts[name] = lambda ids=ids: handoff(*ids)
            posts["layerwise"] = lambda ids=layouts["allocator"]: handoff(*ids, layerwise=True)
            times = _rounds(posts, reps)
            t_raw = statistics.median(times["raw"])
            row = {
                "blocks": n,
                "allocator_runs": [_runs(ids) for ids in layouts["allocator"]],
                "bytes": nbytes,
                "descriptors": n * planes,
                "raw_s": t_raw,
                "raw_gb_s": nbytes / t_raw / 1e9,
            }
            for name in posts:
                if name == "raw":
                    continue
                t = statistics.median(times[name])
                row[f"{name}_s"] = t
                row[f"{name}_gb_s"] = nbytes / t / 1e9
                row[f"{name}_fraction_of_raw"] = statistics.median(
                    r / x for r, x in zip(times["raw"], times[name])
                )
            for name, (ids_src, ids_dst) in layouts.items():
                dst_kv.pool.zero_()  # the rounds overwrote each other's blocks: once more alone
                _once(posts[name])
                row[f"{name}_verified"] = all(
                    torch.equal(
                        src_kv.pool.select(src_kv.block_dim, int(s)),
                        dst_kv.pool.select(dst_kv.block_dim, int(d)),
                    )
                    for s, d in zip(ids_src, ids_dst)
                )
            rows.append(row)
    finally:
        src.close()
        dst.close()
    return rows


def ttft_layerwise(model: str, prompt_lens: list[int], backend: str, reps: int) -> list[dict]:
    from decode.config import DecodeConfig
    from decode.worker import DecodeWorker
    from pdserve.serving.destination import Destination
    from prefill.config import PrefillConfig
    from prefill.worker import PrefillWorker

    args = EngineArgs(
        block_size=16, num_kv_blocks=2 + 2 * max(prompt_lens) // 16, enable_prefix_caching=False
    )
    prefill = PrefillWorker.build(
        model, args, PrefillConfig("bench-prefill"), make_agent(backend, "bench-prefill")
    )
    decode = DecodeWorker.build(
        model, args, DecodeConfig("bench-decode"), make_agent(backend, "bench-decode")
    )
    params = SamplingParams(max_tokens=1, temperature=0)
    rows = []
    try:
        vocab = prefill.core.model_config.vocab_size
        gen = torch.Generator().manual_seed(1)
        for n in prompt_lens:
            prompt = torch.randint(vocab // 4, vocab, (n,), generator=gen).tolist()
            times = {True: [], False: []}
            for i in range(2 * reps + 2):  # alternate modes; the first pair warms up
                layerwise = i % 2 == 0
                rid = f"b{n}-{i}"
                reserved = decode.reserve(rid, prompt, params, lease_s=60)
                dest = Destination(
                    decode.worker_id,
                    decode.endpoint.agent.metadata(),
                    decode.endpoint.layout,
                    reserved.block_ids,
                    fence=reserved.fence,
                )
                prefill.layerwise = layerwise
                start = time.perf_counter()
                prefill.submit(rid, prompt, params, dest).result(timeout=120)
                if i >= 2:
                    times[layerwise].append(time.perf_counter() - start)
                decode.start(rid, 0)  # finishes at once (max_tokens=1) and frees the blocks
            lw, after = statistics.median(times[True]), statistics.median(times[False])
            rows.append(
                {
                    "prompt_tokens": n,
                    "layerwise_s": lw,
                    "after_prefill_s": after,
                    "speedup": after / lw,
                }
            )
    finally:
        prefill.close()
        decode.close()
    return rows


def bench_transfer(model: str = "smollm2-135m", backend: str = "nixl", quick: bool = False) -> dict:
    counts = [1, 4, 16, 64] if quick else [1, 2, 4, 6, 8, 16, 32, 64, 128, 256]
    reps = 3 if quick else 15
    return {
        "benchmark": "transfer",
        "model": model,
        "backend": backend,
        "machine": machine_info(),
        "handoff": handoff_vs_raw(model, counts, backend, reps),
        "ttft": ttft_layerwise(
            model, [64, 256, 1024] if not quick else [64, 256], backend, 3 if quick else 5
        ),
    }


def format_table(report: dict) -> str:
    lines = [
        f"KV handoff vs raw {report['backend']} WRITE, {report['model']} pool layout "
        f"(same process, same bytes; GB/s and fraction of raw)",
        f"{'blocks':>6} {'MiB':>8} {'tiles':>6} {'raw':>7} {'contiguous':>16} {'allocator':>16} "
        f"{'runs':>7} {'scattered':>16} {'per-layer':>16} {'verified':>8}",
    ]
    for r in report["handoff"]:
        ok = all(r[f"{k}_verified"] for k in LAYOUTS)
        cells = {k: f"{r[f'{k}_gb_s']:>8.2f} ({r[f'{k}_fraction_of_raw']:>4.0%})" for k in LAYOUTS}
        runs = "/".join(str(x) for x in r["allocator_runs"])
        per_layer = f"{r['layerwise_gb_s']:>8.2f} ({r['layerwise_fraction_of_raw']:>4.0%})"
        lines.append(
            f"{r['blocks']:>6} {r['bytes'] / 2**20:>8.2f} {r['descriptors']:>6} "
            f"{r['raw_gb_s']:>7.2f} {cells['contiguous']} {cells['allocator']} {runs:>7} "
            f"{cells['scattered']} {per_layer} {str(ok):>8}"
        )
    lines.append("")
    lines.append("time to prefill + push (first token ready on the decode side)")
    lines.append(f"{'prompt':>6} {'layer-wise s':>13} {'after-prefill s':>16} {'speedup':>8}")
    for r in report["ttft"]:
        lines.append(
            f"{r['prompt_tokens']:>6} {r['layerwise_s']:>13.4f} {r['after_prefill_s']:>16.4f} "
            f"{r['speedup']:>7.2f}x"
        )
    return "\n".join(lines)
