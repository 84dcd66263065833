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
    kernel: str
    shape: str
    bytes_moved: int
    triton: Callable[[], object]
    torch_ref: Callable[[], object]


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


def _tables(batch: int, blocks_per_seq: int, device, gen) -> torch.Tensor:
    perm = torch.randperm(batch * blocks_per_seq, generator=gen).to(device)
    return perm.view(batch, blocks_per_seq).to(torch.int32)


def gqa_cases(batches, contexts, heads, dtype, device, block_size) -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for hq, hkv, dim in heads:
        for batch in batches:
            for ctx in contexts:
                nb = -(-ctx // block_size)
                k = torch.randn(batch * nb, block_size, hkv, dim, generator=gen).to(device, dtype)
                v = torch.randn_like(k)
                q = torch.randn(batch, hq, dim, generator=gen).to(device, dtype)
                table = _tables(batch, nb, device, gen)
                lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
                item = k.element_size()
                moved = 2 * batch * ctx * hkv * dim * item + 2 * q.numel() * item
                args = (q, k, v, table, lens, dim**-0.5)
                out.append(
                    Case(
                        "gqa_decode",
                        f"B={batch} ctx={ctx} heads={hq}/{hkv} d={dim}",
                        moved,
                        lambda a=args, c=ctx: paged_gqa_decode(*a, max_context_len=c),
                        lambda a=args, c=ctx: paged_gqa_decode_ref(*a, max_context_len=c),
                    )
                )
    return out


def mla_cases(batches, contexts, heads, rank, rope, dtype, device, block_size) -> list[Case]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for batch in batches:
        for ctx in contexts:
            nb = -(-ctx // block_size)
            latent = torch.randn(batch * nb, block_size, rank + rope, generator=gen)
            latent = latent.to(device, dtype)
            ql = torch.randn(batch, heads, rank, generator=gen).to(device, dtype)
            qp = torch.randn(batch, heads, rope, generator=gen).to(device, dtype)
            table = _tables(batch, nb, device, gen)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            item = latent.element_size()
            moved = batch * ctx * (rank + rope) * item + (2 * ql.numel() + qp.numel()) * item
            args = (ql, qp, latent, table, lens, (rank + rope) ** -0.5)
            out.append(
                Case(
                    "mla_decode",
                    f"B={batch} ctx={ctx} heads={heads} latent={rank}+{rope}",
                    moved,
                    lambda a=args, c=ctx: paged_mla_decode(*a, max_context_len=c),
                    lambda a=args, c=ctx: paged_mla_decode_ref(*a, max_context_len=c),
                )
            )
    return out


def pack_cases(counts, layers, kv_heads, dim, dtype, device, block_size) -> list[Case]:
    gen = torch.Generator().manual_seed(2)
    num_blocks = max(counts) * 2
    pool = torch.randn(layers, 2, num_blocks, block_size, kv_heads, dim, generator=gen)
    pool = pool.to(device, dtype)
    out = []
    for n in counts:
        ids = torch.randperm(num_blocks, generator=gen)[:n].to(device)
        staging = pack_blocks_ref(pool, ids, 2)
        moved = 2 * staging.numel() * staging.element_size()
        mib = staging.numel() * staging.element_size() / 2**20
        shape = f"{n} blocks ({mib:.1f} MiB) L={layers}"
        out.append(
            Case(
                "pack",
                shape,
                moved,
                lambda i=ids: pack_blocks(pool, i, 2),
                lambda i=ids: pack_blocks_ref(pool, i, 2),
            )
        )
        out.append(
            Case(
                "unpack",
                shape,
                moved,
                lambda i=ids, s=staging: unpack_blocks(pool, i, s, 2),
                lambda i=ids, s=staging: unpack_blocks_ref(pool, i, s, 2),
            )
        )
    return out


def bench_kernels(quick: bool = False) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    if gpu and not quick:
        batches, contexts = [1, 16, 64, 128], [1024, 4096, 16384]
        gqa_heads = [(32, 8, 128), (64, 8, 128)]  # Llama-3-8B-like, Llama-3-70B-like
        mla = dict(heads=16, rank=512, rope=64)  # DeepSeek-V3 latent, 16 heads per GPU
        pack = dict(counts=[1, 4, 16, 64, 256], layers=32, kv_heads=8, dim=128)
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
        t_ref = median_seconds(case.torch_ref, device, reps=5)
        t_tri = median_seconds(case.triton, device, reps=5) if gpu else None
        best = t_tri if t_tri is not None else t_ref
        rows.append(
            {
                "kernel": case.kernel,
                "shape": case.shape,
                "bytes": case.bytes_moved,
                "triton_s": t_tri,
                "torch_s": t_ref,
                "triton_gb_s": case.bytes_moved / t_tri / 1e9 if t_tri else None,
                "torch_gb_s": case.bytes_moved / t_ref / 1e9,
                "fraction_of_copy_bw": case.bytes_moved / best / bandwidth,
            }
        )
    return {
        "benchmark": "kernels",
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
        tri = (
            f"{r['triton_s'] * 1e6:>10.1f} {r['triton_gb_s']:>8.1f}"
            if r["triton_s"]
            else (f"{'-':>10} {'-':>8}")
        )
        lines.append(
            f"{r['kernel']:<11} {r['shape']:<44} {r['bytes'] / 2**20:>8.2f} {tri} "
            f"{r['torch_s'] * 1e6:>10.1f} {r['torch_gb_s']:>8.1f} "
            f"{r['fraction_of_copy_bw']:>7.0%}"
        )
    if report["note"]:
        lines.append(report["note"])
    return "\n".join(lines)
