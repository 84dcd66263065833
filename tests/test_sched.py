"""A process's threads at idle scheduling priority (pdserve/serving/sched.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.serving.sched import thread_policies

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task"), reason="Linux only"
)

CHILD = """
import os, threading
from pdserve.serving.sched import thread_policies, yield_cpus

hold = threading.Event()
before = threading.Thread(target=hold.wait)
before.start()
assert set(thread_policies(os.getpid()).values()) == {os.sched_getscheduler(0)}
refused = yield_cpus()
if refused is not None:
    hold.set()
    raise SystemExit("refused: " + refused)
after = threading.Thread(target=hold.wait)  # started later: inherits it
after.start()
policies = thread_policies(os.getpid())
hold.set()
print(len(policies), sorted(set(policies.values())))
"""


def test_every_thread_now_and_later_runs_at_idle_priority():
    child = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60
    )
    if child.stderr.startswith("refused: "):
        pytest.skip(child.stderr.strip())  # a sandbox that refuses scheduling calls
    assert child.returncode == 0, child.stderr
    assert child.stdout.split(maxsplit=1) == ["3", f"[{os.SCHED_IDLE}]\n"]  # main, before, after


def test_thread_policies_reads_each_thread():
    import threading

    policies = thread_policies(os.getpid())
    assert {t.native_id for t in threading.enumerate()} <= set(policies)
    assert policies[threading.get_native_id()] == os.sched_getscheduler(0)
