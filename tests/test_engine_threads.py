"""Building on a thread that goes away (pdserve/engine/threads.py): the OpenMP team a
thread forms lives as long as the thread, so a build done on a thread that exits leaves
no team behind to share the CPUs with the step loop's."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from pdserve.engine.threads import on_own_thread


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settle(want, timeout_s: float = 10.0) -> int:
    """Poll the process's thread count until want(count) (libgomp's threads leave shortly
    after their master exits) -> the last count."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = os_threads()
        if want(count) or time.monotonic() > deadline:
            return count
        time.sleep(0.01)


def parallel_work() -> float:
    # an elementwise op over 16M floats: torch splits it over its threads (a parallel region)
    return float(torch.ones(1 << 24).add_(1).sum())


@pytest.fixture
def two_threads():
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads in /proc")
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a team of 2: the master and one pool thread
    yield
    torch.set_num_threads(before)


def grown_while_held(work) -> int:
    """Threads the process has gained while a thread that ran `work` is still alive (it is
    counted itself, so a bare thread is 0 and one with a team of 2 is 1)."""
    counts, done, release = {}, threading.Event(), threading.Event()

    def hold() -> None:
        counts["before"] = os_threads()
        work()
        done.set()
        release.wait(60)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert done.wait(120)
    during = settle(lambda n: n <= counts["before"], 2.0)
    release.set()
    thread.join(30)
    return during - counts["before"]


def test_a_thread_that_stays_keeps_its_team(two_threads):
    """The control: without it the tests below could not fail."""
    base = settle(lambda n: True, 0)
    assert grown_while_held(parallel_work) >= 1
    assert settle(lambda n: n <= base) <= base  # and it goes when the thread does


def test_the_build_thread_takes_its_team_with_it(two_threads):
    results = []
    assert grown_while_held(lambda: results.append(on_own_thread(parallel_work))) <= 0
    assert results == [float(2 * (1 << 24))]


def test_the_result_and_the_error_come_back_to_the_caller():
    assert on_own_thread(lambda a, b=0: a + b, 1, b=2) == 3
    caller = threading.get_ident()
    assert on_own_thread(threading.get_ident) != caller

    def fail() -> None:
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        on_own_thread(fail)


def test_building_an_engine_leaves_no_team_on_the_building_thread(two_threads):
    """build_engine builds on a thread of its own; the same build done on the caller's
    thread (the control) leaves a team there for as long as the caller lives."""
    from pdserve.engine.args import EngineArgs
    from pdserve.engine.build import _build_single, build_engine
    from pdserve.weights import resolve

    args = EngineArgs(num_kv_blocks=256)
    source, device = resolve("tiny-llama"), args.resolve_device()
    dtype = args.resolve_dtype(device)
    assert grown_while_held(lambda: _build_single(source, args, device, dtype)) >= 1
    assert grown_while_held(lambda: build_engine("tiny-llama", args)) <= 0
