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


def test_a_thread_that_stays_keeps_its_team(two_threads):
    """The control: without it the test below could not fail."""
    base = settle(lambda n: True, 0)
    done, release = threading.Event(), threading.Event()

    def stay() -> None:
        parallel_work()
        done.set()
        release.wait(30)

    thread = threading.Thread(target=stay, daemon=True)
    thread.start()
    assert done.wait(30)
    # the thread itself, and its team's pool thread, for as long as it lives
    assert settle(lambda n: n >= base + 2) >= base + 2
    release.set()
    thread.join(30)
    assert settle(lambda n: n <= base) <= base


def test_the_build_thread_takes_its_team_with_it(two_threads):
    base = settle(lambda n: True, 0)
    assert on_own_thread(parallel_work) == float(2 * (1 << 24))
    assert settle(lambda n: n <= base) <= base


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

    def grown(build) -> int:
        """Threads the process gained while a caller thread that built an engine lives."""
        counts, built, release = {}, threading.Event(), threading.Event()

        def caller() -> None:
            counts["before"] = os_threads()
            build()
            built.set()
            release.wait(60)

        thread = threading.Thread(target=caller, daemon=True)
        thread.start()
        assert built.wait(120)
        after = settle(lambda n: n <= counts["before"], 2.0)
        release.set()
        thread.join(30)
        return after - counts["before"]

    source = resolve("tiny-llama")
    device = args.resolve_device()
    assert grown(lambda: _build_single(source, args, device, args.resolve_dtype(device))) >= 1
    assert grown(lambda: build_engine("tiny-llama", args)) <= 0
