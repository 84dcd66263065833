"""Building on a thread that goes away (pdserve/engine/threads.py): the OpenMP team a
thread forms lives as long as the thread, so a build done on a thread that exits leaves
no team behind to share the CPUs with the step loop's.

The thread counts are taken in a fresh interpreter: in pytest's own process, threads that
earlier tests left (readers, gRPC, spill writers) may start or end while one is counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from pdserve.engine.threads import on_own_thread

COUNTS = r"""
import json, os, threading, time
import torch
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import _build_single, build_engine
from pdserve.engine.threads import on_own_thread
from pdserve.weights import resolve

torch.set_num_threads(2)  # a team of 2: its master and one pool thread

def tids():
    return set(os.listdir("/proc/self/task"))

def parallel_work():
    # an elementwise op over 16M floats: torch splits it over its threads (a parallel region)
    return float(torch.ones(1 << 24).add_(1).sum())

def left_while_held(work):
    # threads that came with `work` and are still there while the thread that ran it lives
    out, done, release = {}, threading.Event(), threading.Event()
    def hold():
        before = tids()
        work()
        deadline = time.monotonic() + 2.0  # a team's threads leave shortly after their master
        while time.monotonic() < deadline and tids() - before:
            time.sleep(0.01)
        out["new"] = len(tids() - before)
        done.set()
        release.wait(60)
    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    done.wait(120)
    release.set()
    thread.join(30)
    return out["new"]

args = EngineArgs(num_kv_blocks=256)
source, device = resolve("tiny-llama"), args.resolve_device()
dtype = args.resolve_dtype(device)
base = tids()
stay = left_while_held(parallel_work)
deadline = time.monotonic() + 10.0
while time.monotonic() < deadline and tids() - base:
    time.sleep(0.01)
result = []
print(json.dumps({
    "stay": stay,
    "gone_with_its_thread": len(tids() - base),
    "own_thread": left_while_held(lambda: result.append(on_own_thread(parallel_work))),
    "result": result,
    "build_here": left_while_held(lambda: _build_single(source, args, device, dtype)),
    "build_engine": left_while_held(lambda: build_engine("tiny-llama", args)),
}))
"""


@pytest.fixture(scope="module")
def counts() -> dict:
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads in /proc")
    out = subprocess.run(
        [sys.executable, "-c", COUNTS], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_thread_that_stays_keeps_its_team(counts):
    """The control: without it the tests below could not fail."""
    assert counts["stay"] >= 1  # its pool thread, for as long as it lives
    assert counts["gone_with_its_thread"] == 0


def test_the_build_thread_takes_its_team_with_it(counts):
    assert counts["own_thread"] == 0
    assert counts["result"] == [float(2 * (1 << 24))]


def test_building_an_engine_leaves_no_team_on_the_building_thread(counts):
    """build_engine builds on a thread of its own; the same build done on the caller's
    thread (the control) leaves a team there for as long as the caller lives."""
    assert counts["build_here"] >= 1
    assert counts["build_engine"] == 0


def test_the_result_and_the_error_come_back_to_the_caller():
    assert on_own_thread(lambda a, b=0: a + b, 1, b=2) == 3
    caller = threading.get_ident()
    assert on_own_thread(threading.get_ident) != caller

    def fail() -> None:
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        on_own_thread(fail)


INTERRUPTED = r"""
import os, signal, threading, time
from pdserve.engine.threads import on_own_thread

finished = []

def build():
    time.sleep(0.5)
    finished.append(time.monotonic())

threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    on_own_thread(build)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted after the build" if finished else "interrupted during the build")
"""


def test_an_interrupted_caller_waits_for_the_build_before_it_raises():
    """Ctrl-C while a build runs: the KeyboardInterrupt comes once the build has ended, never
    with a half-built engine still building behind the caller."""
    out = subprocess.run(
        [sys.executable, "-c", INTERRUPTED], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "interrupted after the build", out.stderr[-2000:]
