"""Waiting on processes the tests start (and on the processes those start)."""

from __future__ import annotations

import os
import time


def wait_gone(pid: int, timeout_s: float = 60.0) -> None:
    """Until no process has `pid` (polled); AssertionError past the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs")
