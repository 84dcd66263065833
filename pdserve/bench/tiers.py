"""`pdserve bench tiers`: spill and reload throughput per tier against raw moves of the same
bytes, in the same run.

For n blocks of the model's real KV pool (every layer, K and V), laid out as one run of
consecutive blocks or scattered (every other block), a spill is what the scheduler does on
preemption (`OffloadedKV.park`: the blocks packed by kernels/block_copy straight into the
tier's memory; for disk, until the file is written) and a reload the way back
(`OffloadedKV.unpark`: read, verify checksums for disk, unpack into the blocks). The tiers
are built as a worker builds them (pdserve/engine/build.py `tiers`): on a CUDA machine the
host tier's memory is pinned, the emulated CXL tier's is not. Baselines, same bytes: host
and CXL against one contiguous copy (on CPU one tensor copy; on CUDA device -> pinned host
for a spill, pinned host -> device for a reload); disk against one sequential file write of
a ready host buffer, then one read into a reused buffer (on CUDA too: no device copy in it).
Rounds alternate tier and baseline; a fraction of raw is the median over rounds of their
time ratio. Every reload is checked bit-exact against the blocks spilled (every block of
the sequence is zeroed before it). On CUDA every timed window ends with a device
synchronize, so the GPU work a call queued is inside it.

Each round also times the passes a spill and a reload are made of, alone, on the same
blocks: the pack (kernels/block_copy: the Triton kernel into a device staging buffer on
CUDA, as OffloadedKV packs there; the reference into a reused host buffer on CPU), on CUDA
the staging's copy to pinned host memory and back, the disk tier's per-block checksum, the
unpack. Their bound, as a fraction of raw, is what a tier could reach if it did nothing but
those passes: host and CXL spill = pack (+ the copy to host on CUDA), reload = (the copy
to the device on CUDA +) unpack; disk spill = pack (+ copy to host) + checksum + the raw
write in series (on a machine with cores to spare the writer thread could overlap them: the
overlapped bound, raw / max(pack + copy + checksum, raw write), is reported beside it),
disk reload = the raw read + checksum (+ copy to the device) + unpack. A tier near its bound
is limited by those passes (strided copies of scattered blocks, the page cache's copy, the
PCIe copy), not by how it chains them. On CUDA the disk tier packs into pageable memory, the
pass into pinned: its bound there is optimistic.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import MappingProxyType

import numpy as np
import torch

from kernels.block_copy import pack_blocks, pack_blocks_ref, unpack_blocks, unpack_blocks_ref
from pdserve.bench.report import machine_info
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import tiers
from pdserve.kv import KVCache
from pdserve.kv.offload import OffloadedKV
from pdserve.progress import progress
from pdserve.weights.source import model_config
from transfer.tiers import DiskTier, MemoryTier
from transfer.tiers.disk import checksum

# the sequence's blocks: one run of consecutive blocks (what the allocator hands out when it
# can), or every other block (a sequence that grew among others: no two blocks adjacent)
LAYOUTS = ("run", "scattered")
# (device type, quick) -> blocks per sequence, rounds timed (one more warms up). On CUDA a
# Llama-3-8B-shaped block in bf16 is 2 MiB: 256 blocks are 512 MiB, a long prompt's KV. The
# full run took 28 s on one H200 (docs/results/gpu/gpu-check-run1.log), the disk cases most.
COUNTS = MappingProxyType(
    {
        ("cpu", False): ((1, 2, 6, 16, 64, 128), 7),
        ("cpu", True): ((1, 6, 32), 3),
        ("cuda", False): ((1, 4, 16, 64, 256), 5),
        ("cuda", True): ((1, 16, 64), 3),
    }
)
_DEVICE_COPY = "device -> pinned host copy / pinned host -> device copy"
BASELINES = MappingProxyType(
    {
        "cpu": MappingProxyType(
            {"host": "tensor copy", "cxl": "tensor copy", "disk": "file write/read"}
        ),
        "cuda": MappingProxyType(
            {"host": _DEVICE_COPY, "cxl": _DEVICE_COPY, "disk": "file write/read of host bytes"}
        ),
    }
)


def _clock(device: torch.device) -> Callable[[], float]:
    """perf_counter once everything queued on `device` is done: a timed window then holds
    the GPU work queued inside it."""
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def _median_ratio(raw: list[float], tier: list[float]) -> float:
    return statistics.median(r / t for r, t in zip(raw, tier))


def _raw_copy(pool_side: torch.Tensor, host: torch.Tensor, now) -> tuple[float, float]:
    """Seconds of one contiguous copy of the same bytes each way. On CPU both buffers are
    host memory: one copy, timed once for both. On CUDA `pool_side` is on the device and
    `host` pinned: device -> host (what a spill moves), host -> device (a reload)."""
    start = now()
    host.copy_(pool_side, non_blocking=True)
    wrote = now() - start
    if pool_side.device == host.device:
        return wrote, wrote
    start = now()
    pool_side.copy_(host, non_blocking=True)
    return wrote, now() - start


def _raw_file(data: np.ndarray, into: memoryview, directory: str) -> tuple[float, float]:
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


def _passes(kv: KVCache, ids: list[int], host: torch.Tensor, now) -> dict[str, float]:
    """Seconds of each pass of a spill and a reload of `ids`, alone: pack, (CUDA) the packed
    blocks' copy into `host` (bytes, pinned), checksum every block of `host`, (CUDA) the copy
    back to the device, unpack (the same values: the pool is unchanged). Ids are a host
    tensor, the kernels' fast path (kernels/block_copy.py)."""
    pool, dim = kv.pool, kv.block_dim
    block_ids = torch.tensor(ids, dtype=torch.int32)
    cuda = pool.device.type == "cuda"
    start = now()
    if cuda:
        packed = pack_blocks(pool, block_ids, dim)
    else:
        packed = pack_blocks_ref(pool, block_ids, dim, out=host.view(pool.dtype))
    pack = now() - start
    shipped = host.view(pool.dtype).view(packed.shape)  # host's bytes as the staging rows
    to_host = to_device = 0.0  # on CPU the packed blocks are in host memory already
    if cuda:
        start = now()
        shipped.copy_(packed, non_blocking=True)
        to_host = now() - start
    start = now()
    for row in host.numpy().reshape(len(ids), -1):
        checksum(row)
    summed = now() - start
    if cuda:
        start = now()
        packed = shipped.to(pool.device, non_blocking=True)
        to_device = now() - start
    start = now()
    (unpack_blocks if cuda else unpack_blocks_ref)(pool, block_ids, packed, dim)
    return {
        "pack": pack,
        "to_host": to_host,
        "checksum": summed,
        "to_device": to_device,
        "unpack": now() - start,
    }


def _bounds(name: str, raw_w: float, raw_r: float, t: dict[str, float]) -> dict[str, float]:
    """The passes' bounds as fractions of raw (module docstring)."""
    out = t["pack"] + t["to_host"]  # until the packed blocks are in host memory
    back = t["to_device"] + t["unpack"]  # from host memory into the blocks
    if name != "disk":
        return {"spill": raw_w / out, "reload": raw_r / back}
    return {
        "spill": raw_w / (out + t["checksum"] + raw_w),
        "spill_overlapped": raw_w / max(out + t["checksum"], raw_w),
        "reload": raw_r / (raw_r + t["checksum"] + back),
    }


@dataclass(frozen=True)
class _Buffers:
    """One of each, of the largest case's bytes; a case uses the first bytes of each."""

    pool_side: torch.Tensor  # random bytes on the pool's device: one end of a raw copy
    host: torch.Tensor  # the other end (pinned on CUDA); also the raw file write's data
    staging: torch.Tensor  # the passes' host buffer (pinned on CUDA)
    into: memoryview  # the raw file read's reused buffer

    @staticmethod
    def make(nbytes: int, device: torch.device) -> _Buffers:
        pin = device.type == "cuda"
        pool_side = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).copy_(pool_side)
        staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        return _Buffers(pool_side, host, staging, memoryview(bytearray(nbytes)))


def _case(offload: OffloadedKV, n: int, layout: str, reps: int, b: _Buffers, tmp: str, now) -> dict:
    """One tier, one sequence of n blocks: a warm-up round, then `reps` timed ones -> its row."""
    kv, tier = offload.cache, offload.tiers[0]
    ids = list(range(n)) if layout == "run" else list(range(0, 2 * n, 2))
    dim, nbytes = kv.block_dim, len(ids) * tier.block_bytes
    at = torch.tensor(ids, device=kv.pool.device)  # for the checks, outside the timed windows
    spill_t, reload_t, raw_w, raw_r, exact = [], [], [], [], True
    bounds: list[dict[str, float]] = []
    for r in range(reps + 1):
        expected = kv.pool.index_select(dim, at)
        start = now()
        placed = offload.park("k", ids)
        if isinstance(tier, DiskTier):
            tier.flush()
        t_spill = now() - start
        if placed != tier.name:
            raise RuntimeError(f"the {tier.name} tier did not take the blocks")
        kv.pool.index_fill_(dim, at, 0)  # a reload must restore every block
        start = now()
        reloaded = offload.unpark("k", ids)
        t_reload = now() - start
        if not reloaded:
            raise RuntimeError(f"a reload from the {tier.name} tier failed")
        exact &= torch.equal(kv.pool.index_select(dim, at), expected)
        if isinstance(tier, DiskTier):
            w, rd = _raw_file(b.host[:nbytes].numpy(), b.into[:nbytes], tmp)
        else:
            w, rd = _raw_copy(b.pool_side[:nbytes], b.host[:nbytes], now)
        passes = _passes(kv, ids, b.staging[:nbytes], now)
        if r:  # round 0 warms up
            bounds.append(_bounds(tier.name, w, rd, passes))
            spill_t.append(t_spill)
            reload_t.append(t_reload)
            raw_w.append(w)
            raw_r.append(rd)
    return {
        "tier": tier.name,
        "layout": layout,
        "blocks": n,
        "bytes": nbytes,
        "spill_gb_s": nbytes / statistics.median(spill_t) / 1e9,
        "reload_gb_s": nbytes / statistics.median(reload_t) / 1e9,
        "raw_write_gb_s": nbytes / statistics.median(raw_w) / 1e9,
        "raw_read_gb_s": nbytes / statistics.median(raw_r) / 1e9,
        "spill_fraction_of_raw": _median_ratio(raw_w, spill_t),
        "reload_fraction_of_raw": _median_ratio(raw_r, reload_t),
        "bound_of_raw": {k: statistics.median(b[k] for b in bounds) for k in bounds[0]},
        "bit_exact": exact,
        "emulated": getattr(tier, "emulated", False),  # CXL without a device
    }


def bench_tiers(
    model: str = "smollm2-135m", quick: bool = False, device: str = "cpu", dtype: str = "auto"
) -> dict:
    """`device`: cpu, cuda or cuda:N (ValueError where CUDA is not available); `dtype`:
    float32, float16, bfloat16 or auto (float32 on CPU, bfloat16 on CUDA), as the engine's."""
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-tiers-") as tmp:
        # the tiers hold one sequence at a time; sizes given, so no machine share applies
        args = EngineArgs(device=device, dtype=dtype, preemption="tiered", spill_dir=tmp)
        dev = args.resolve_device()
        dt = args.resolve_dtype(dev)
        counts, reps = COUNTS[dev.type, quick]
        most = max(counts)
        args = replace(args, spill_host_blocks=most, spill_cxl_blocks=most, spill_disk_blocks=most)
        kv = KVCache(model_config(model), 2 * most, 16, dt, dev)  # scattered ids reach 2n - 2
        kv.pool.normal_()
        block_bytes = kv.nbytes // kv.num_blocks
        buffers, now = _Buffers.make(most * block_bytes, dev), _clock(dev)
        stores = [OffloadedKV(kv, [tier]) for tier in tiers(args, kv)]
        pinned = {  # page-locked tier memory (the disk tier's buffers are pageable)
            s.tiers[0].name: isinstance(s.tiers[0], MemoryTier) and s.tiers[0].slots.is_pinned()
            for s in stores
        }
        rows = []
        try:
            cases = [(n, layout) for n in counts for layout in LAYOUTS]
            for n, layout in progress(cases, desc="bench tiers", unit="case"):
                rows += [_case(s, n, layout, reps, buffers, tmp, now) for s in stores]
        finally:
            for offload in stores:
                offload.close()
    return {
        "benchmark": "tiers",
        "model": model,
        "device": str(dev),
        "dtype": str(dt).removeprefix("torch."),
        "block_bytes": block_bytes,
        "rounds": reps,
        "pinned": pinned,
        "baselines": dict(BASELINES[dev.type]),
        "machine": machine_info(),
        "rows": rows,
    }


def _bound(row: dict, key: str) -> str:
    bound = row.get("bound_of_raw", {}).get(key)  # reports written before the bound lack it
    return "-" if bound is None else f"{bound:.0%}"


def format_table(report: dict) -> str:
    on = f"{report['dtype']} on {report['device']}, " if "device" in report else ""
    lines = [
        f"spill tiers, {report['model']} blocks of {report['block_bytes'] / 2**10:.0f} KiB "
        f"(every layer), {on}GB/s and fraction of the raw move of the same bytes",
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
    baselines = report["baselines"]
    lines.append(f"raw: host/cxl {baselines['host']}; disk {baselines['disk']}")
    if "pinned" in report:
        pinned = ", ".join(f"{t} {'yes' if p else 'no'}" for t, p in report["pinned"].items())
        lines.append(f"tier memory pinned: {pinned} (as a worker builds its tiers)")
    lines.append(
        "bound: what the spill's or reload's passes alone allow, as a fraction of raw (pack, "
        "unpack, on CUDA with the copy to or from pinned host memory; for disk with the "
        "checksum and the raw write or read in series)"
    )
    lines.append("cxl is an emulated tier here (no CXL device): DRAM paced to 32 GB/s + 0.4 us")
    return "\n".join(lines)
