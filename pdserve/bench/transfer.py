"""`pdserve bench transfer`: the KV handoff against a raw NIXL WRITE of the same bytes, and
TTFT with layer-wise push against push-after-prefill.

Part 1 (same process, two NIXL agents, the model's real KV pool layout): for n blocks, the
handoff writes one prepared tile per (layer plane, block), one WRITE per layer, as the
prefill worker does; the raw baseline writes the same number of bytes as one contiguous
descriptor.
Throughput = bytes / (first post -> every transfer DONE), median of `reps`.

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
from pdserve.progress import progress
from pdserve.sampling_params import SamplingParams
from pdserve.serving.kv_endpoint import pool_geometry
from pdserve.weights import resolve
from transfer import Desc, make_agent


def _timed(post, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        transfers = post()
        for t in transfers:
            t.wait(timeout_s=60)
        times.append(time.perf_counter() - start)
        for t in transfers:
            t.release()
    return statistics.median(times)


def handoff_vs_raw(model: str, counts: list[int], backend: str, reps: int) -> list[dict]:
    config = resolve(model).config
    blocks = max(counts)
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
        for n in progress(counts, desc="bench transfer", unit="size"):
            nbytes = n * planes * geometry.block_bytes
            layouts = {
                # a fresh pool hands out consecutive blocks: NIXL merges adjacent tiles
                "contiguous": (np.arange(n), np.arange(n) + (blocks - n)),
                # a long-running pool's blocks are scattered: one descriptor per tile
                "scattered": (
                    torch.randperm(blocks, generator=gen)[:n].numpy(),
                    torch.randperm(blocks, generator=gen)[:n].numpy(),
                ),
            }

            def raw(nbytes=nbytes):
                return [src.write(peer, [Desc(rs, 0, nbytes)], [Desc(rd, 0, nbytes)], b"")]

            t_raw = _timed(raw, reps)
            row = {
                "blocks": n,
                "bytes": nbytes,
                "descriptors": n * planes,
                "raw_s": t_raw,
                "raw_gb_s": nbytes / t_raw / 1e9,
            }
            for name, (ids_src, ids_dst) in layouts.items():

                def handoff(ids_src=ids_src, ids_dst=ids_dst):
                    # what the prefill worker does: one write of prepared tiles per layer
                    return [
                        src.write_tiles(
                            peer,
                            local_tiles,
                            geometry.tile_indices(layer, ids_src),
                            remote_tiles,
                            geometry.tile_indices(layer, ids_dst),
                            b"",
                        )
                        for layer in range(config.num_layers)
                    ]

                dst_kv.pool.zero_()
                t = _timed(handoff, reps)
                verified = all(
                    torch.equal(
                        src_kv.pool.select(src_kv.block_dim, int(s)),
                        dst_kv.pool.select(dst_kv.block_dim, int(d)),
                    )
                    for s, d in zip(ids_src, ids_dst)
                )
                row[f"{name}_s"] = t
                row[f"{name}_gb_s"] = nbytes / t / 1e9
                row[f"{name}_fraction_of_raw"] = t_raw / t
                row[f"{name}_verified"] = verified
            rows.append(row)
    finally:
        src.close()
        dst.close()
    return rows


def ttft_layerwise(model: str, prompt_lens: list[int], backend: str, reps: int) -> list[dict]:
    from decode.worker import DecodeWorker
    from prefill.worker import Destination, PrefillWorker

    args = EngineArgs(
        block_size=16, num_kv_blocks=2 + 2 * max(prompt_lens) // 16, enable_prefix_caching=False
    )
    prefill = PrefillWorker(model, "bench-prefill", backend, args)
    decode = DecodeWorker(model, "bench-decode", backend, args)
    params = SamplingParams(max_tokens=1, temperature=0)
    rows = []
    try:
        wire = decode.wire()
        vocab = prefill.engine.model_config.vocab_size
        gen = torch.Generator().manual_seed(1)
        for n in prompt_lens:
            prompt = torch.randint(vocab // 4, vocab, (n,), generator=gen).tolist()
            times = {True: [], False: []}
            for i in range(2 * reps + 2):  # alternate modes; the first pair warms up
                layerwise = i % 2 == 0
                rid = f"b{n}-{i}"
                blocks = decode.reserve(rid, prompt, params, lease_s=60)
                dest = Destination(
                    decode.worker_id,
                    decode.agent.metadata(),
                    blocks,
                    wire["wire_version"],
                    wire["layout_hash"],
                    decode.geometry,
                    wire["region"],
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
    counts = [1, 4, 16, 64] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    reps = 3 if quick else 7
    return {
        "benchmark": "transfer",
        "model": model,
        "backend": backend,
        "machine": machine_info(),
        "handoff": handoff_vs_raw(model, counts, backend, reps),
        "ttft": ttft_layerwise(model, [64, 256, 1024] if not quick else [64, 256], backend, reps),
    }


def format_table(report: dict) -> str:
    lines = [
        f"KV handoff vs raw {report['backend']} WRITE, {report['model']} pool layout "
        f"(same process, same bytes; GB/s and fraction of raw)",
        f"{'blocks':>6} {'MiB':>8} {'tiles':>6} {'raw':>7} {'contiguous':>16} {'scattered':>16} "
        f"{'verified':>8}",
    ]
    for r in report["handoff"]:
        ok = r["contiguous_verified"] and r["scattered_verified"]
        cont = f"{r['contiguous_gb_s']:>8.2f} ({r['contiguous_fraction_of_raw']:>4.0%})"
        scat = f"{r['scattered_gb_s']:>8.2f} ({r['scattered_fraction_of_raw']:>4.0%})"
        lines.append(
            f"{r['blocks']:>6} {r['bytes'] / 2**20:>8.2f} {r['descriptors']:>6} "
            f"{r['raw_gb_s']:>7.2f} {cont} {scat} {str(ok):>8}"
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
