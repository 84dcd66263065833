"""A worker's heartbeat thread that fails (a bug in its stats, not a router that is away)
stops the worker instead of leaving it running, unseen by the router."""

from __future__ import annotations

import subprocess
import sys
import threading

from pdserve.rpc import pdserve_pb2 as pb
from pdserve.serving.registration import Registration

INFO = pb.WorkerInfo(worker_id="w", role="decode", address="127.0.0.1:9")


def _broken_stats():
    raise OverflowError("cannot convert float infinity to integer")


def test_a_failing_heartbeat_calls_on_failure():
    failed = threading.Event()
    reg = Registration("127.0.0.1:9", INFO, _broken_stats, on_failure=failed.set)
    assert failed.wait(timeout=10)
    reg.close()


def test_by_default_a_failing_heartbeat_stops_the_process():
    script = (
        "import threading\n"
        "from pdserve.rpc import pdserve_pb2 as pb\n"
        "from pdserve.serving.registration import Registration\n"
        "def stats():\n"
        "    raise OverflowError('boom')\n"
        "Registration('127.0.0.1:9', pb.WorkerInfo(worker_id='w', role='decode'), stats)\n"
        "threading.Event().wait(60)\n"
        "print('still running')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=90
    )
    assert done.returncode == -15, (done.returncode, done.stdout, done.stderr)  # SIGTERM
    assert "still running" not in done.stdout
    assert "the heartbeat failed" in done.stderr and "OverflowError" in done.stderr
