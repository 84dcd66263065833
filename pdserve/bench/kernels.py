"""`pdserve bench kernels`: decode-attention and KV-movement kernels against the memory roofline.

For every kernel and shape: median time, the bytes the kernel must move (each KV byte read
once, outputs written once, block tables and scalars ignored), achieved GB/s, and that as a
fraction of the device's copy bandwidth measured in the same run (a large device-to-device
`copy_`, counted as read + write). The torch reference is timed beside the Triton kernel.
On a machine without CUDA only the torch references are timed and the report says that the
Triton numbers need a GPU (the interpreter measures Python, not the kernel).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import (
    pack_blocks,
    pack_blocks_ref,
    paged_gqa_decode,
    paged_gqa_decode_ref,
    paged_mla_decode,
    paged_mla_decode_ref,
    unpack_blocks,
    unpack_blocks_ref,
)
from pdserve.bench.report import machine_info
from pdserve.progress import progress


@dataclass(frozen=True)
class Case:
    """One kernel at one shape. `build` makes its inputs on the device and returns the Triton
    call and the torch reference: inputs are made when the case is timed and dropped after,
    so a grid whose inputs together exceed the device (a 128 x 16k-token batch is 8 GiB of
    KV) runs one case's worth at a time."""

    kernel: str
    shape: str
    bytes_moved: int
    build: Callable[[], tuple[Callable[[], object], Callable[[], object]]]


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, reps=5)
    return 2 * nbytes / seconds


def _random(shape, seed: int, device, dtype) -> torch.Tensor:
    """Seeded normal values drawn on the device itself (host draws of GiBs take seconds)."""
    gen = torch.Generator(device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device).to(dtype)


def _tables(batch: int, blocks_per_seq: int, device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device).manual_seed(seed)
    perm = torch.randperm(batch * blocks_per_seq, generator=gen, device=device)
    return perm.view(batch, blocks_per_seq).to(torch.int32)


def _item(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def gqa_cases(batches, contexts, heads, dtype, device, block_size) -> list[Case]:
    item = _item(dtype)
    out = []
    for hq, hkv, dim in heads:
        for batch in batches:
            for ctx in contexts:

                def build(hq=hq, hkv=hkv, dim=dim, batch=batch, ctx=ctx, **tile):
                    nb = -(-ctx // block_size)
                    k = _random((batch * nb, block_size, hkv, dim), 0, device, dtype)
                    v = _random(k.shape, 1, device, dtype)
                    q = _random((batch, hq, dim), 2, device, dtype)
                    table = _tables(batch, nb, device, 3)
                    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
                    args = (q, k, v, table, lens, dim**-0.5)
                    return (
                        lambda: paged_gqa_decode(*args, max_context_len=ctx, **tile),
                        lambda: paged_gqa_decode_ref(*args, max_context_len=ctx),
                    )

                moved = 2 * batch * ctx * hkv * dim * item + 2 * batch * hq * dim * item
                shape = f"B={batch} ctx={ctx} heads={hq}/{hkv} d={dim}"
                out.append(Case("gqa_decode", shape, moved, build))
    return out


def mla_cases(batches, contexts, heads, rank, rope, dtype, device, block_size) -> list[Case]:
    item = _item(dtype)
    out = []
    for batch in batches:
        for ctx in contexts:

            def build(batch=batch, ctx=ctx, **tile):
                nb = -(-ctx // block_size)
                latent = _random((batch * nb, block_size, rank + rope), 4, device, dtype)
                ql = _random((batch, heads, rank), 5, device, dtype)
                qp = _random((batch, heads, rope), 6, device, dtype)
                table = _tables(batch, nb, device, 7)
                lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
                args = (ql, qp, latent, table, lens, (rank + rope) ** -0.5)
                return (
                    lambda: paged_mla_decode(*args, max_context_len=ctx, **tile),
                    lambda: paged_mla_decode_ref(*args, max_context_len=ctx),
                )

            moved = batch * ctx * (rank + rope) * item + batch * heads * (2 * rank + rope) * item
            shape = f"B={batch} ctx={ctx} heads={heads} latent={rank}+{rope}"
            out.append(Case("mla_decode", shape, moved, build))
    return out


def pack_cases(counts, layers, kv_heads, dim, dtype, device, block_size) -> list[Case]:
    num_blocks = max(counts) * 2
    pool = _random((layers, 2, num_blocks, block_size, kv_heads, dim), 8, device, dtype)
    out = []
    for n in counts:
        # host ids, as the spill path passes them (kernels/block_copy.py: no device wait)
        ids = _tables(1, num_blocks, device, 9 + n).view(-1)[:n].long().cpu()
        nbytes = 2 * layers * n * block_size * kv_heads * dim * _item(dtype)  # K and V
        moved = 2 * nbytes  # read once, written once
        shape = f"{n} blocks ({nbytes / 2**20:.1f} MiB) L={layers}"

        def pack(i=ids):
            return (lambda: pack_blocks(pool, i, 2), lambda: pack_blocks_ref(pool, i, 2))

        def unpack(i=ids):
            staging = pack_blocks_ref(pool, i, 2)
            return (
                lambda: unpack_blocks(pool, i, staging, 2),
                lambda: unpack_blocks_ref(pool, i, staging, 2),
            )

        out += [Case("pack", shape, moved, pack), Case("unpack", shape, moved, unpack)]
    return out


def _timed(fn: Callable[[], object], device: torch.device) -> float | None:
    """Median seconds, or None when `fn` runs out of device memory (the torch reference
    materialises every sequence's KV, repeated per query head: 8 x 4 GiB at 128 x 16k)."""
    try:
        return median_seconds(fn, device, reps=5)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


# (batch, context) of the tile sweep: a batch-bound shape and one long sequence (split-KV)
TILE_SHAPES = ((64, 4096), (1, 16384))
TILE_TOKENS = (16, 32, 64, 128)
TILE_WARPS = (4, 8)
# MLA also over pipelining stages (Triton's default: 3) and more splits than the automatic
# choice: with every tokens x warps tile at the default it stayed at 34-47% of the H200's
# copy bandwidth (docs/gpu-h200.md), so the loads' overlap and the programs in flight are
# the next suspects
MLA_TILE_STAGES = (1, 2, 4)
MLA_TILE_SPLITS = (16, 32)


def tiles_for(kernel: str) -> list[dict]:
    """The launch options (the kernels' keyword arguments) `bench kernels --tiles` tries."""
    tiles = [dict(tokens_per_step=t, num_warps=w) for t in TILE_TOKENS for w in TILE_WARPS]
    if kernel == "mla_decode":
        tiles += [
            dict(tokens_per_step=t, num_warps=w, num_stages=s)
            for t in (32, 64)
            for w in TILE_WARPS
            for s in MLA_TILE_STAGES
        ]
        tiles += [dict(tokens_per_step=64, num_warps=8, num_splits=n) for n in MLA_TILE_SPLITS]
    return tiles


def _time_tile(case: Case, tile: dict, device, bandwidth: float) -> dict:
    triton_fn, torch_fn = case.build(**tile)
    error = (triton_fn().float() - torch_fn().float()).abs().max().item()
    seconds = median_seconds(triton_fn, device, reps=5)
    return {
        "triton_s": seconds,
        "gb_s": case.bytes_moved / seconds / 1e9,
        "fraction_of_copy_bw": case.bytes_moved / seconds / bandwidth,
        "max_abs_diff_vs_torch": error,
    }


def tile_rows(cases: list[Case], device: torch.device, bandwidth: float) -> list[dict]:
    """Each decode case at every tile of `tiles_for` (tokens per loop step x warps, for MLA
    also stages and splits; None: the kernel's default): time, GB/s and the largest
    difference from the torch reference's output (a tile that is fast but wrong shows
    here). What the kernels' *_TOKENS, *_WARPS and *_STAGES are chosen from."""
    rows = []
    pairs = [(c, tile) for c in cases for tile in tiles_for(c.kernel)]
    for case, tile in progress(pairs, desc="bench kernels tiles", unit="tile"):
        row = {
            "kernel": case.kernel,
            "shape": case.shape,
            "tokens": tile["tokens_per_step"],
            "warps": tile["num_warps"],
            "stages": tile.get("num_stages"),
            "splits": tile.get("num_splits"),
        }
        try:
            row.update(_time_tile(case, tile, device, bandwidth))
        except Exception as e:  # a tile that does not fit (memory, registers), or fails
            if device.type == "cuda":
                torch.cuda.empty_cache()
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def bench_kernels(quick: bool = False, tiles: bool = False) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    if gpu and not quick:
        batches, contexts = [1, 16, 64, 128, 256], [1024, 4096, 16384, 32768]
        gqa_heads = [(32, 8, 128), (64, 8, 128)]  # Llama-3-8B-like, Llama-3-70B-like
        mla = dict(heads=16, rank=512, rope=64)  # DeepSeek-V3 latent, 16 heads per GPU
        pack = dict(counts=[1, 4, 16, 64, 256, 1024], layers=32, kv_heads=8, dim=128)
        copy_bytes = 2**30
    else:
        batches, contexts = [1, 8], [256, 1024]
        gqa_heads = [(8, 2, 64)]
        mla = dict(heads=8, rank=128, rope=32)
        pack = dict(counts=[1, 16, 64], layers=4, kv_heads=2, dim=64)
        copy_bytes = 2**26
    bs = 16
    cases = gqa_cases(batches, contexts, gqa_heads, dtype, device, bs)
    cases += mla_cases(batches, contexts, dtype=dtype, device=device, block_size=bs, **mla)
    cases += pack_cases(dtype=dtype, device=device, block_size=bs, **pack)
    bandwidth = copy_bandwidth(device, copy_bytes)
    rows = []
    for case in progress(cases, desc="bench kernels", unit="case"):
        try:
            triton_fn, torch_fn = case.build()
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            triton_fn = torch_fn = None
        t_ref = _timed(torch_fn, device) if torch_fn else None
        t_tri = _timed(triton_fn, device) if gpu and triton_fn else None
        del triton_fn, torch_fn  # the case's inputs go before the next case's are made
        if t_ref is None and t_tri is None:
            rows.append({"kernel": case.kernel, "shape": case.shape, "error": "out of memory"})
            continue
        best = t_tri if t_tri is not None else t_ref
        rows.append(
            {
                "kernel": case.kernel,
                "shape": case.shape,
                "bytes": case.bytes_moved,
                "triton_s": t_tri,
                "torch_s": t_ref,  # None: the reference ran out of device memory
                "triton_gb_s": case.bytes_moved / t_tri / 1e9 if t_tri else None,
                "torch_gb_s": case.bytes_moved / t_ref / 1e9 if t_ref else None,
                "fraction_of_copy_bw": case.bytes_moved / best / bandwidth,
            }
        )
    tile_report = None
    if tiles and gpu and not quick:  # the tile shapes are in the full grid only
        picks = []
        for batch, ctx in TILE_SHAPES:
            picks += gqa_cases([batch], [ctx], gqa_heads[:1], dtype, device, bs)
            picks += mla_cases([batch], [ctx], dtype=dtype, device=device, block_size=bs, **mla)
        tile_report = tile_rows(picks, device, bandwidth)
    return {
        "benchmark": "kernels",
        "tiles": tile_report,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "dtype": str(dtype),
        "block_size": bs,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "triton_timed": gpu,
        "note": None
        if gpu
        else "no CUDA device: only the torch references were timed; the Triton numbers need a GPU",
        "flashinfer_flashmla": "not compared: neither package is wired into this benchmark",
        "machine": machine_info(),
        "results": rows,
    }


def format_table(report: dict) -> str:
    lines = [
        f"kernel roofline on {report['device']} ({report['dtype']}), copy bandwidth "
        f"{report['copy_bandwidth_gb_s']:.1f} GB/s (measured in this run)",
        f"{'kernel':<11} {'shape':<44} {'MiB':>8} {'triton us':>10} {'GB/s':>8} "
        f"{'torch us':>10} {'GB/s':>8} {'of copy':>8}",
    ]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"{r['kernel']:<11} {r['shape']:<44} {r['error']}")
            continue
        tri = (
            f"{r['triton_s'] * 1e6:>10.1f} {r['triton_gb_s']:>8.1f}"
            if r["triton_s"]
            else (f"{'-':>10} {'-':>8}")
        )
        ref = (
            f"{r['torch_s'] * 1e6:>10.1f} {r['torch_gb_s']:>8.1f}"
            if r["torch_s"]
            else f"{'OOM':>10} {'-':>8}"
        )
        lines.append(
            f"{r['kernel']:<11} {r['shape']:<44} {r['bytes'] / 2**20:>8.2f} {tri} {ref} "
            f"{r['fraction_of_copy_bw']:>7.0%}"
        )
    if report["note"]:
        lines.append(report["note"])
    if report.get("tiles"):
        lines.append("tiles (tokens per loop step x warps x stages x splits; - = default):")
        lines.append(
            f"{'kernel':<11} {'shape':<44} {'tokens':>6} {'warps':>5} {'stages':>6} "
            f"{'splits':>6} {'us':>10} {'GB/s':>8} {'of copy':>8} {'max diff':>9}"
        )
        for r in report["tiles"]:
            stages, splits = (r.get(k) or "-" for k in ("stages", "splits"))
            head = (
                f"{r['kernel']:<11} {r['shape']:<44} {r['tokens']:>6} {r['warps']:>5} "
                f"{stages:>6} {splits:>6}"
            )
            if "error" in r:
                lines.append(f"{head} {r['error'][:60]}")
                continue
            lines.append(
                f"{head} {r['triton_s'] * 1e6:>10.1f} {r['gb_s']:>8.1f} "
                f"{r['fraction_of_copy_bw']:>7.0%} {r['max_abs_diff_vs_torch']:>9.2e}"
            )
    return "\n".join(lines)
