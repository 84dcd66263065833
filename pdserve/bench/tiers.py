"""`pdserve bench tiers`: spill and reload throughput per tier against raw moves of the same
bytes, in the same run.

For n blocks of the model's real KV pool (every layer, K and V), laid out as one run of
consecutive blocks or scattered (every other block), a spill is what the scheduler does on
preemption (`OffloadedKV.park`: the blocks packed by kernels/block_copy straight into the
tier's memory; for disk, until the file is written) and a reload the way back
(`OffloadedKV.unpark`: read, verify checksums for disk, unpack into the blocks). Baselines,
same bytes: host and CXL against one contiguous tensor copy; disk against one sequential
file write of a ready buffer, then one read into a reused buffer. Rounds alternate tier and
baseline; a fraction of raw is the median over rounds of their time ratio. Every reload is checked
bit-exact against the blocks spilled.

Each round also times the passes a spill and a reload are made of, alone, on the same
blocks: the pack (kernels/block_copy, into a reused buffer), the disk tier's per-block
checksum, the unpack. Their bound, as a fraction of raw, is what a tier could reach if
it did nothing but those passes: host and CXL spill = the pack (it writes straight into
the tier's memory), reload = the unpack; disk spill = pack + checksum + the raw write in
series (on a machine with cores to spare the writer thread could overlap them: the
overlapped bound, raw / max(pack + checksum, raw write), is reported beside it), disk
reload = the raw read + checksum + unpack. A tier near its bound is limited by those
passes (strided copies of scattered blocks, the page cache's copy), not by how it
chains them.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from kernels.block_copy import pack_blocks_ref, unpack_blocks_ref
from pdserve.bench.report import machine_info
from pdserve.kv import KVCache
from pdserve.kv.offload import OffloadedKV
from pdserve.progress import progress
from pdserve.weights import resolve
from transfer.tiers import CXLTier, DiskTier, MemoryTier
from transfer.tiers.disk import checksum

# the sequence's blocks: one run of consecutive blocks (what the allocator hands out when it
# can), or every other block (a sequence that grew among others: no two blocks adjacent)
LAYOUTS = ("run", "scattered")


def _median_ratio(raw: list[float], tier: list[float]) -> float:
    return statistics.median(r / t for r, t in zip(raw, tier))


def _raw_file(data: bytes, into: bytearray, directory: str) -> tuple[float, float]:
    """Seconds to write `data` to a new file with one sequential write, then to read it back
    with one read into a reused buffer (no page faults: the fastest plain read)."""
    path = os.path.join(directory, "raw.bin")
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        f.write(data)
    wrote = time.perf_counter() - start
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        f.readinto(into)
    read = time.perf_counter() - start
    os.unlink(path)
    return wrote, read


def _passes(kv: KVCache, ids: list[int], buffer: torch.Tensor) -> dict[str, float]:
    """Seconds of each pass of a spill and a reload of `ids`, alone: pack into `buffer`,
    checksum every block of it, unpack it back (the same values: the pool is unchanged)."""
    block_ids = torch.tensor(ids, dtype=torch.int32)
    start = time.perf_counter()
    staged = pack_blocks_ref(kv.pool, block_ids, kv.block_dim, out=buffer)
    pack = time.perf_counter() - start
    rows = buffer.numpy()[: staged.numel()].view("uint8").reshape(len(ids), -1)
    start = time.perf_counter()
    for row in rows:
        checksum(row)
    summed = time.perf_counter() - start
    start = time.perf_counter()
    unpack_blocks_ref(kv.pool, block_ids, staged, kv.block_dim)
    return {"pack": pack, "checksum": summed, "unpack": time.perf_counter() - start}


def _bounds(name: str, raw_w: float, raw_r: float, t: dict[str, float]) -> dict[str, float]:
    """The passes' bounds as fractions of raw (module docstring)."""
    if name != "disk":
        return {"spill": raw_w / t["pack"], "reload": raw_r / t["unpack"]}
    return {
        "spill": raw_w / (t["pack"] + t["checksum"] + raw_w),
        "spill_overlapped": raw_w / max(t["pack"] + t["checksum"], raw_w),
        "reload": raw_r / (raw_r + t["checksum"] + t["unpack"]),
    }


def bench_tiers(model: str = "smollm2-135m", quick: bool = False) -> dict:
    config = resolve(model).config
    counts = [1, 6, 32] if quick else [1, 2, 6, 16, 64, 128]
    reps = 3 if quick else 7
    blocks = 2 * max(counts)
    kv = KVCache(config, blocks, 16, torch.float32, torch.device("cpu"))
    kv.pool.normal_()
    block_bytes = kv.nbytes // blocks
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-tiers-") as tmp:
        tiers = {
            "host": lambda: MemoryTier(blocks, block_bytes),
            "cxl": lambda: CXLTier(blocks, block_bytes),
            "disk": lambda: DiskTier(blocks, block_bytes, root=tmp),
        }
        cases = [(n, layout) for n in counts for layout in LAYOUTS]
        for n, layout in progress(cases, desc="bench tiers", unit="case"):
            ids = list(range(n)) if layout == "run" else list(range(0, 2 * n, 2))
            nbytes = n * block_bytes
            src = torch.randn(nbytes // 4)
            dst = torch.empty_like(src)
            buffer = torch.empty_like(src)  # the passes' pack target
            payload, into = src.numpy().tobytes(), bytearray(nbytes)
            for name, make in tiers.items():
                tier = make()
                offload = OffloadedKV(kv, [tier])
                spill_t, reload_t, raw_w, raw_r, exact = [], [], [], [], True
                bounds: list[dict[str, float]] = []
                for r in range(reps + 1):
                    expected = [kv.pool.select(kv.block_dim, b).clone() for b in ids]
                    start = time.perf_counter()
                    assert offload.park("k", ids) == name
                    if name == "disk":
                        tier.flush()
                    t_spill = time.perf_counter() - start
                    kv.pool.select(kv.block_dim, ids[0]).zero_()  # reload must restore it
                    start = time.perf_counter()
                    assert offload.unpark("k", ids)
                    t_reload = time.perf_counter() - start
                    exact &= all(
                        torch.equal(kv.pool.select(kv.block_dim, b), e)
                        for b, e in zip(ids, expected)
                    )
                    if name == "disk":
                        w, rd = _raw_file(payload, into, tmp)
                    else:
                        start = time.perf_counter()
                        dst.copy_(src)
                        w = rd = time.perf_counter() - start
                    passes = _passes(kv, ids, buffer)
                    if r:  # round 0 warms up
                        bounds.append(_bounds(name, w, rd, passes))
                        spill_t.append(t_spill)
                        reload_t.append(t_reload)
                        raw_w.append(w)
                        raw_r.append(rd)
                offload.close()
                rows.append(
                    {
                        "tier": name,
                        "layout": layout,
                        "blocks": n,
                        "bytes": nbytes,
                        "spill_gb_s": nbytes / statistics.median(spill_t) / 1e9,
                        "reload_gb_s": nbytes / statistics.median(reload_t) / 1e9,
                        "raw_write_gb_s": nbytes / statistics.median(raw_w) / 1e9,
                        "raw_read_gb_s": nbytes / statistics.median(raw_r) / 1e9,
                        "spill_fraction_of_raw": _median_ratio(raw_w, spill_t),
                        "reload_fraction_of_raw": _median_ratio(raw_r, reload_t),
                        "bound_of_raw": {
                            k: statistics.median(b[k] for b in bounds) for k in bounds[0]
                        },
                        "bit_exact": exact,
                        "emulated": name == "cxl",
                    }
                )
    return {
        "benchmark": "tiers",
        "model": model,
        "block_bytes": block_bytes,
        "baselines": {"host": "tensor copy", "cxl": "tensor copy", "disk": "file write/read"},
        "machine": machine_info(),
        "rows": rows,
    }


def _bound(row: dict, key: str) -> str:
    bound = row.get("bound_of_raw", {}).get(key)  # reports written before the bound lack it
    return "-" if bound is None else f"{bound:.0%}"


def format_table(report: dict) -> str:
    lines = [
        f"spill tiers, {report['model']} blocks of {report['block_bytes'] / 2**10:.0f} KiB "
        f"(every layer); GB/s and fraction of the raw move of the same bytes",
        f"{'tier':<5} {'layout':<9} {'blocks':>6} {'MiB':>8} {'spill':>7} {'raw':>7} {'of raw':>7} "
        f"{'bound':>6} {'reload':>7} {'raw':>7} {'of raw':>7} {'bound':>6} {'exact':>6}",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['tier']:<5} {r.get('layout', 'scattered'):<9} {r['blocks']:>6} "
            f"{r['bytes'] / 2**20:>8.1f} {r['spill_gb_s']:>7.2f} "
            f"{r['raw_write_gb_s']:>7.2f} {r['spill_fraction_of_raw']:>7.0%} "
            f"{_bound(r, 'spill'):>6} {r['reload_gb_s']:>7.2f} {r['raw_read_gb_s']:>7.2f} "
            f"{r['reload_fraction_of_raw']:>7.0%} {_bound(r, 'reload'):>6} "
            f"{str(r['bit_exact']):>6}"
        )
    lines.append(
        "bound: what the spill's or reload's passes alone allow, as a fraction of raw (pack, "
        "unpack; for disk with the checksum and the raw write or read in series)"
    )
    lines.append("cxl is an emulated tier here (no CXL device): DRAM paced to 32 GB/s + 0.4 us")
    return "\n".join(lines)
