"""Failpoints (pdserve/failpoints.py): armed by a file, claimed once, marked with who hit
them and why, and the places that take them fail the way their resource would."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from pdserve.failpoints import NO_FAILPOINTS, Failpoints, arm, disarm, fired
from transfer.tiers import DiskTier, TierError


def test_nothing_is_armed_without_a_directory(tmp_path):
    assert NO_FAILPOINTS.hit("disk.write", "f1") is None
    arm(str(tmp_path), os.getpid(), "disk.write", "error")
    assert NO_FAILPOINTS.hit("disk.write", "f1") is None  # a worker started without the flag


def test_one_hit_claims_it_and_leaves_a_marker(tmp_path):
    fp = Failpoints(str(tmp_path))
    assert fp.hit("disk.write", "f1") is None
    assert fired(str(tmp_path), "any", "disk.write") is None
    arm(str(tmp_path), os.getpid(), "disk.write", "error")
    assert fp.hit("kv.reload", "r1") is None  # another point
    assert fp.hit("disk.write", "f1") == "error"
    assert fp.hit("disk.write", "f2") is None  # claimed: once only
    assert fired(str(tmp_path), os.getpid(), "disk.write") == (os.getpid(), "f1")


def test_any_is_claimed_by_exactly_one_of_many_threads(tmp_path):
    fp = Failpoints(str(tmp_path))
    arm(str(tmp_path), "any", "disk.write", "error")
    results: list = []
    barrier = threading.Barrier(8)

    def race(i: int) -> None:
        barrier.wait()
        results.append(fp.hit("disk.write", f"r{i}"))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("error") == 1 and results.count(None) == 7
    pid, detail = fired(str(tmp_path), "any", "disk.write")
    assert pid == os.getpid() and detail in {f"r{i}" for i in range(8)}


def test_repeat_stays_armed_until_disarmed(tmp_path):
    fp = Failpoints(str(tmp_path))
    arm(str(tmp_path), "any", "disk.write", "error repeat")
    assert [fp.hit("disk.write", f"f{i}") for i in range(3)] == ["error"] * 3
    assert fired(str(tmp_path), "any", "disk.write") == (os.getpid(), "f0")  # the first
    disarm(str(tmp_path), "any", "disk.write")
    assert fp.hit("disk.write", "f3") is None


def test_bad_arms_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not one of"):
        arm(str(tmp_path), "any", "kv.nowhere", "kill")
    with pytest.raises(ValueError, match="not one of"):
        arm(str(tmp_path), "any", "kv.spill", "explode")
    with pytest.raises(ValueError, match="only decode.feed, disk.write can fail"):
        arm(str(tmp_path), "any", "kv.spill", "error")  # nothing there would fail
    with pytest.raises(ValueError, match="pause takes seconds"):
        arm(str(tmp_path), "any", "kv.spill", "pause soon")
    (tmp_path / "any.kv.spill").write_text("explode")  # written by hand
    with pytest.raises(ValueError, match="explode"):
        Failpoints(str(tmp_path)).hit("kv.spill")


@pytest.mark.parametrize("action", ["kill", "pause 0.5"])
def test_a_process_strikes_itself_where_armed(tmp_path, action):
    """kill is a real SIGKILL of the process that gets there; pause only holds it."""
    code = (
        "import sys; from pdserve.failpoints import Failpoints; "
        "Failpoints(sys.argv[1]).hit('decode.reserve', 'r9'); print('survived')"
    )
    arm(str(tmp_path), "any", "decode.reserve", action)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    pid, detail = fired(str(tmp_path), "any", "decode.reserve")
    assert detail == "r9" and pid != os.getpid()
    if action == "kill":
        assert done.returncode == -9 and "survived" not in done.stdout
    else:  # held there for its half second, then on
        assert done.returncode == 0 and "survived" in done.stdout
        assert time.monotonic() - started >= 0.5


def test_a_disk_write_that_fails_loses_the_entry_never_its_bytes(tmp_path):
    """disk.write error: the writer's write fails as on a full file system (ENOSPC) after
    put() returned; the entry reads back as a TierError (the caller recomputes), the next
    entry is written again, and close() leaves nothing."""
    fp = Failpoints(str(tmp_path / "fp"))
    os.mkdir(tmp_path / "fp")
    tier = DiskTier(8, 64, root=str(tmp_path), failpoints=fp)
    data = torch.arange(2 * 16, dtype=torch.float32).view(2, 1, 16)
    arm(str(tmp_path / "fp"), os.getpid(), "disk.write", "error")
    tier.put("a", data)
    with pytest.raises(TierError, match="No space left"):
        tier.get("a")
    tier.put("b", data)
    assert torch.equal(tier.get("b"), data)
    tier.discard("a")
    tier.discard("b")
    tier.check_integrity()
    assert tier.used_blocks == 0
    directory = tier.directory
    tier.close()
    assert not os.path.exists(directory)
