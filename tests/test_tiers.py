"""Spill tiers: bit-exact round trips, exact slot accounting, checksums, failures that fall
back instead of crashing, and a spill directory that is private and gone after close."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time

import pytest
import torch

from transfer.tiers import (
    BlockSource,
    CorruptBlock,
    CXLTier,
    DiskTier,
    MemoryTier,
    ReloadFailed,
    SpillFailed,
    TierError,
    TierFull,
    place,
    read_into,
)
from transfer.tiers import disk as disk_mod

PLANES, ELEMS = 6, 40  # a staging row: one block of every layer plane


def staging(n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, PLANES, ELEMS, generator=g).to(dtype)


def block_bytes(dtype=torch.float32) -> int:
    return PLANES * ELEMS * torch.empty((), dtype=dtype).element_size()


def make(kind: str, capacity: int, tmp_path, dtype=torch.float32):
    bb = block_bytes(dtype)
    if kind == "host":
        return MemoryTier(capacity, bb)
    if kind == "cxl":
        return CXLTier(capacity, bb)  # emulated
    if kind == "cxl-file":
        return CXLTier(capacity, bb, path=str(tmp_path / "cxl.mem"))
    return DiskTier(capacity, bb, root=str(tmp_path))


KINDS = ["host", "cxl", "cxl-file", "disk"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_bit_exact(kind, dtype, tmp_path):
    tier = make(kind, 8, tmp_path, dtype)
    try:
        a, b = staging(3, dtype, seed=1), staging(5, dtype, seed=2)
        tier.put("a", a)
        tier.put("b", b)
        tier.check_integrity()
        assert tier.used_blocks == 8
        got_b, got_a = tier.get("b"), tier.get("a")
        assert got_a.dtype == dtype and torch.equal(got_a.view(torch.uint8), a.view(torch.uint8))
        assert torch.equal(got_b.view(torch.uint8), b.view(torch.uint8))
        tier.discard("a")
        tier.check_integrity()
        assert tier.used_blocks == 5 and "a" not in tier and "b" in tier
    finally:
        tier.close()


@pytest.mark.parametrize("kind", KINDS)
def test_capacity_is_exact_and_freed_space_is_reused(kind, tmp_path):
    tier = make(kind, 4, tmp_path)
    try:
        tier.put("x", staging(3))
        with pytest.raises(TierFull):
            tier.put("y", staging(2))
        tier.check_integrity()
        assert tier.used_blocks == 3
        tier.put("y", staging(1, seed=5))
        assert tier.used_blocks == 4
        tier.discard("x")
        tier.put("z", staging(3, seed=6))
        tier.check_integrity()
        assert torch.equal(tier.get("z"), staging(3, seed=6))
        assert torch.equal(tier.get("y"), staging(1, seed=5))
        with pytest.raises(ValueError, match="already stored"):
            tier.put("z", staging(1))
    finally:
        tier.close()


def test_memory_slots_are_taken_lowest_first():
    tier = MemoryTier(6, block_bytes())
    tier.put("a", staging(2))
    tier.put("b", staging(2))
    tier.discard("a")
    tier.put("c", staging(3))
    assert tier._entries["c"][0] == [0, 1, 4]
    tier.check_integrity()


def read_back(tier, key) -> torch.Tensor:
    pieces = []
    read_into(tier, key, lambda rows, start, stop: pieces.append(rows.clone()))
    return torch.cat(pieces)


def test_place_fills_host_then_cxl_then_disk_and_reads_back_bit_exact(tmp_path):
    bb = block_bytes()
    tiers = [MemoryTier(2, bb), CXLTier(2, bb), DiskTier(8, bb, root=str(tmp_path))]
    try:
        data = {k: staging(2, seed=i) for i, k in enumerate("abcd")}
        where = {k: place(tiers, k, v) for k, v in data.items()}
        assert [where[k].name for k in "abcd"] == ["host", "cxl", "disk", "disk"]
        for k in "dbca":
            assert torch.equal(read_back(where[k], k), data[k])
            where[k].discard(k)
            assert k not in where[k]
            where[k].check_integrity()
        host, disk = tiers[0].stats, tiers[2].stats
        assert host.spilled_bytes == host.reloaded_bytes == 2 * bb
        assert disk.spills == 2 and tiers[2].used_blocks == 0
        # every successful move is timed (what the cost-aware policy learns park costs from)
        assert all(t.stats.spill_s > 0 and t.stats.reload_s > 0 for t in tiers)
        with pytest.raises(ReloadFailed, match="holds no entry 'a'"):
            read_into(tiers[0], "a", lambda *_: None)
    finally:
        for tier in tiers:
            tier.close()


def test_no_room_anywhere_is_spill_failed(tmp_path):
    tier = MemoryTier(1, block_bytes())
    with pytest.raises(SpillFailed, match="no tier took 'big'"):
        place([tier], "big", staging(2))
    assert tier.used_blocks == 0
    tier.check_integrity()


def test_corrupted_spill_file_is_detected_by_its_checksum(tmp_path):
    tier = DiskTier(8, block_bytes(), root=str(tmp_path))
    try:
        place([tier], "r", staging(3))
        entry = tier._entries["r"]
        entry.written.wait()
        with open(entry.path, "r+b") as f:  # flip the bits of one byte of the last block
            f.seek(-5, os.SEEK_END)
            byte = f.read(1)[0]
            f.seek(-5, os.SEEK_END)
            f.write(bytes([byte ^ 0xFF]))
        with pytest.raises(CorruptBlock, match="block 2 of 'r' fails its checksum"):
            tier.get("r")
        with pytest.raises(ReloadFailed, match="checksum"):
            read_into(tier, "r", lambda *_: None)
        place([tier], "r2", staging(1))
        tier._entries["r2"].written.wait()
        open(tier._entries["r2"].path, "wb").close()  # truncated to nothing
        with pytest.raises(ReloadFailed, match="truncated"):
            read_into(tier, "r2", lambda *_: None)
    finally:
        tier.close()


def test_a_full_file_system_is_tier_full_and_placing_moves_on(tmp_path, monkeypatch):
    disk = DiskTier(8, block_bytes(), root=str(tmp_path))
    full = shutil._ntuple_diskusage(total=1 << 30, used=1 << 30, free=1024)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)
    with pytest.raises(TierFull, match="is full"):
        disk.put("x", staging(1))
    with pytest.raises(SpillFailed, match="is full"):
        place([disk], "x", staging(1))
    disk.close()


def test_an_unwritable_spill_directory_warns_and_falls_back(tmp_path, caplog):
    disk = DiskTier(8, block_bytes(), root=str(tmp_path))
    shutil.rmtree(disk.directory)  # e.g. cleaned away under us
    host = MemoryTier(4, block_bytes())
    assert place([disk, host], "x", staging(1)) is host
    assert "not writable" in caplog.text
    with pytest.raises(TierError, match="not writable"):
        disk.put("y", staging(1))
    disk.close()
    with pytest.raises(TierError, match="cannot create a spill directory"):
        DiskTier(8, block_bytes(), root=str(tmp_path / "no" / "such" / "dir"))


def test_spill_directory_is_private_and_gone_after_close(tmp_path):
    tier = DiskTier(8, block_bytes(), root=str(tmp_path))
    tier.put("a", staging(2))
    entry = tier._entries["a"]
    entry.written.wait()
    assert stat.S_IMODE(os.stat(tier.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(entry.path).st_mode) == 0o600
    tier.close()
    assert not os.path.exists(tier.directory)


def test_a_disk_tier_nobody_closed_leaves_no_directory_at_exit(tmp_path):
    """A script's engine (the LLM parks in the tiers by default) that never calls close()."""
    script = (
        "from transfer.tiers import DiskTier\n"
        f"tier = DiskTier(8, 4096, root={str(tmp_path)!r})\n"
        "print(tier.directory)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    directory = done.stdout.strip()
    assert directory.startswith(str(tmp_path))
    assert not os.path.exists(directory)
    assert os.listdir(tmp_path) == []


def test_emulated_cxl_takes_at_least_its_modelled_time():
    bb = block_bytes()
    tier = CXLTier(64, bb, bandwidth_gb_s=0.001, latency_us=1000)  # 1 MB/s, 1 ms
    assert tier.emulated
    data = staging(32)
    start = time.perf_counter()
    tier.put("a", data)
    spent = time.perf_counter() - start
    assert spent >= 1e-3 + data.numel() * 4 / 1e6
    tier.close()


def source_of(data: torch.Tensor, calls: list | None = None, fail_at: int | None = None):
    """A BlockSource over packed rows that records the pieces asked for (and can fail)."""

    def fill(out, start, stop):
        if fail_at is not None and start <= fail_at < stop:
            raise RuntimeError("pack failed")
        if calls is not None:
            calls.append((start, stop))
        out.copy_(data[start:stop])

    return BlockSource(data.shape[0], tuple(data.shape[1:]), data.dtype, fill)


def test_memory_tier_packs_straight_into_each_run_of_free_slots():
    tier = MemoryTier(8, block_bytes())
    tier.put("a", staging(2))
    tier.put("b", staging(1))
    tier.put("c", staging(2))
    tier.discard("a")
    tier.discard("c")  # free: 0, 1, 3, 4, 5, 6, 7
    calls, data = [], staging(4, seed=9)
    tier.put("d", source_of(data, calls))
    assert tier._entries["d"][0] == [0, 1, 3, 4] and calls == [(0, 2), (2, 4)]
    pieces = []
    assert tier.get_into("d", lambda rows, a, b: pieces.append((a, b, rows.clone()))) == 4
    assert [(a, b) for a, b, _ in pieces] == [(0, 2), (2, 4)]
    assert torch.equal(torch.cat([r for _, _, r in pieces]), data)
    assert torch.equal(tier.get("d"), data)  # the gathered copy agrees
    tier.check_integrity()


@pytest.mark.parametrize("kind", KINDS)
def test_a_failing_pack_stores_nothing(kind, tmp_path):
    tier = make(kind, 8, tmp_path)
    try:
        with pytest.raises(RuntimeError, match="pack failed"):
            tier.put("x", source_of(staging(5), fail_at=3))
        assert "x" not in tier and tier.used_blocks == 0
        tier.check_integrity()
        if kind == "disk":
            assert os.listdir(tier.directory) == [disk_mod.OWNER]  # no entry file
        tier.put("x", staging(5))  # the key and the room are free again
        assert torch.equal(tier.get("x"), staging(5))
    finally:
        tier.close()


def test_disk_tier_writes_and_verifies_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_mod, "CHUNK_BYTES", 2 * block_bytes())  # 2 blocks per piece
    tier = DiskTier(16, block_bytes(), root=str(tmp_path))
    try:
        calls, data = [], staging(5, seed=3)
        tier.put("a", source_of(data, calls))
        assert calls == [(0, 2), (2, 4), (4, 5)]
        tier.flush()
        entry = tier._entries["a"]
        assert os.path.getsize(entry.path) == 5 * block_bytes()  # the blocks, nothing else
        pieces = []
        tier.get_into("a", lambda rows, a, b: pieces.append((a, b, rows.clone())))
        assert [(a, b) for a, b, _ in pieces] == [(0, 2), (2, 4), (4, 5)]
        assert torch.equal(torch.cat([r for _, _, r in pieces]), data)
        with open(entry.path, "r+b") as f:  # corrupt block 3: the second piece fails
            f.seek(3 * block_bytes() + 17)
            byte = f.read(1)[0]
            f.seek(3 * block_bytes() + 17)
            f.write(bytes([byte ^ 0x01]))
        seen = []
        with pytest.raises(CorruptBlock, match="block 3 of 'a' fails its checksum"):
            tier.get_into("a", lambda rows, a, b: seen.append((a, b)))
        assert seen == [(0, 2)]  # nothing from the bad piece reached the sink
    finally:
        tier.close()


def test_a_sigkilled_workers_spill_directory_is_gone_after_the_next_start(tmp_path):
    """SIGKILL runs no close(): the next disk tier under the same root removes the dead
    process's directory, and only that one (a live process's, and a directory without a
    valid OWNER file, stay)."""
    import signal
    import subprocess
    import sys

    from transfer.tiers.disk import DiskTier

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from transfer.tiers.disk import DiskTier\n"
            f"tier = DiskTier(8, 1024, root={str(tmp_path)!r})\n"
            "print(tier.directory, flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    dead_dir = child.stdout.readline().strip()
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    assert os.path.isdir(dead_dir)
    live = DiskTier(8, 1024, root=str(tmp_path))  # this process: alive
    foreign = tmp_path / "pdserve-spill-foreign"
    foreign.mkdir()
    (foreign / "OWNER").write_text("not a pid\n")
    reused = tmp_path / "pdserve-spill-reused"  # our pid, another start time: pid reuse
    reused.mkdir()
    (reused / "OWNER").write_text(f"{os.getpid()} 1\n")
    try:
        assert live.removed_stale == [dead_dir]
        assert not os.path.exists(dead_dir)
        again = DiskTier(8, 1024, root=str(tmp_path))
        assert again.removed_stale == [str(reused)]
        assert os.path.isdir(live.directory) and foreign.is_dir()
        again.close()
    finally:
        live.close()


def test_default_tier_sizes_are_bounded_by_this_machine_and_given_sizes_stand(monkeypatch):
    from pdserve.engine import build
    from pdserve.engine.args import EngineArgs

    gib, block = 2**30, 2**20  # a GPU-sized pool of 1 MiB blocks: 4x it is 400 GiB
    monkeypatch.setattr(build, "available_memory_bytes", lambda: 64 * gib)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(0, 0, 100 * gib)
    )
    sizes = dict(build.bounded_tier_sizes(EngineArgs(preemption="tiered"), 100_000, block))
    assert sizes == {"host": 16 * 1024, "cxl": 8 * 1024, "disk": 50 * 1024}  # 25%, 12.5%, 50%
    assert dict(build.tier_sizes(EngineArgs(preemption="tiered"), 100_000)) == {
        "host": 400_000, "cxl": 400_000, "disk": 6_400_000,  # the simulator's: not bounded
    }  # fmt: skip
    given = EngineArgs(
        preemption="tiered", spill_host_blocks=99_999, cxl_path="/dev/dax0.0", spill_disk_blocks=7
    )
    assert dict(build.bounded_tier_sizes(given, 100_000, block)) == {
        "host": 99_999, "cxl": 400_000, "disk": 7,  # given, a real CXL device, given
    }  # fmt: skip
    small = dict(build.bounded_tier_sizes(EngineArgs(preemption="tiered"), 64, block))
    assert small == {"host": 256, "cxl": 256, "disk": 4096}  # a small pool's defaults fit
