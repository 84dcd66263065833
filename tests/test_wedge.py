"""Issue 14's critical wedge, as first reported: SIGKILL one of two decode workers while
prefills keep pushing KV to both, and the prefill worker must keep completing prompts for
the survivor. Written against the plain launcher and client only (no newer API), so that
the same file runs against older trees."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.client import Client
from pdserve.launch import Cluster

CLIENTS = 16
PROMPT_TOKENS = 299


@pytest.mark.parametrize("prefill_tp", [1, 2], ids=["prefill", "tensor-parallel-prefill"])
def test_prefill_keeps_serving_the_survivor_after_a_decode_worker_dies_under_load(prefill_tp):
    """With a tensor-parallel prefill worker every rank pushes its own heads: each rank's
    WRITEs to the dead worker fail on their own, and the group stays in service."""
    tp = {} if prefill_tp == 1 else {"prefill_tp": prefill_tp}  # older trees: no such flag
    with Cluster("tiny-llama", 1, 2, worker_args=["--num-kv-blocks", "1024"], **tp) as c:
        client = Client(c.address)
        done: list[float] = []
        failed: list[str] = []
        stop = threading.Event()

        def loop(i: int) -> None:
            prompt = [(i * 7 + k) % 380 + 1 for k in range(PROMPT_TOKENS)]
            while not stop.is_set():
                try:
                    client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
                    done.append(time.monotonic())
                except Exception as e:  # noqa: BLE001 - counted, asserted below
                    failed.append(str(e)[:200])

        try:
            with ThreadPoolExecutor(CLIENTS) as pool:
                futures = [pool.submit(loop, i) for i in range(CLIENTS)]
                deadline = time.monotonic() + 120
                while len(done) < 2 * CLIENTS:  # both decode workers busy, pushes in flight
                    assert time.monotonic() < deadline, (len(done), failed[:3])
                    time.sleep(0.05)
                decode_0 = c.procs[2]  # router, prefill, decode, decode: launch order
                os.kill(decode_0.pid, signal.SIGKILL)
                killed = time.monotonic()

                def served_after() -> list[float]:
                    return [t for t in done if killed + 3 <= t <= killed + 15]

                # until the survivor has served a round of every client (from 3 s after the
                # kill on), or 15 s have passed (the wedge: then nothing more completes)
                while len(served_after()) < CLIENTS and time.monotonic() < killed + 15:
                    time.sleep(0.1)
                stop.set()
                for f in futures:
                    f.result(timeout=300)
        finally:
            stop.set()
            client.close()
        after = served_after()
        # the wedge: nothing completed for minutes, every request ended DEADLINE_EXCEEDED
        assert len(after) >= CLIENTS, f"{len(after)} completed in the 12 s after the kill"
        assert not failed, f"{len(failed)} failed, e.g. {failed[:3]}"
        assert c.procs[1].poll() is None, "the prefill worker left service"
