"""Requests that survive their workers: launched clusters on 127.0.0.1 (real processes, NIXL)
under concurrent greedy streams while a worker is SIGKILLed or SIGSTOPped mid-stream. Every
request completes with the colocated engine's tokens (none lost, none repeated), and the
survivors hold no block afterwards."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve import LLM, SamplingParams
from pdserve.client import Client, build_request, timings_of
from pdserve.launch import Cluster

MAX_NEW = 160
PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(8)]
PARAMS = dict(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    params = SamplingParams(**PARAMS)
    return [o.token_ids for o in LLM("tiny-llama").generate(PROMPTS, params)]


def running(metrics_address: str) -> float:
    """pdserve_decode_running from a decode worker's /metrics (set at every step)."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return float(re.search(r"^pdserve_decode_running (\S+)$", text, re.M).group(1))


def busiest_decode(c: Cluster) -> tuple[str, int]:
    """(name, pid) of the decode worker running the most requests now."""
    names = [n for n in c.names if n.startswith("decode")]
    name = max(names, key=lambda n: running(c.metrics[n]))
    assert running(c.metrics[name]) > 0, "no decode worker runs a request"
    return name, c.procs[c.names.index(name)].pid


def pid_of(c: Cluster, worker_id: str) -> int:
    """Worker ids are ROLE-PID-SUFFIX (pdserve serve's default)."""
    pid = int(worker_id.split("-")[1])
    assert pid in [p.pid for p in c.procs]
    return pid


def run_streams(client: Client, on_started) -> list:
    """All PROMPTS at once; `on_started()` once every stream has its first tokens."""
    started = [False] * len(PROMPTS)

    def one(i: int):
        tokens, final = [], None
        for msg in client.stub.Generate(build_request(PROMPTS[i], PARAMS), timeout=180):
            tokens.extend(msg.token_ids)
            started[i] = True
            if msg.finished:
                final = timings_of(msg.timings), msg.finish_reason
        return tokens, final

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(one, i) for i in range(len(PROMPTS))]
        deadline = time.monotonic() + 60
        while not all(started):
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.01)
        on_started()
        return [f.result(timeout=180) for f in futures]


def survivors_free(client: Client, dead: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        held = [
            (w.worker_id, w.free_blocks, w.total_blocks)
            for w in client.workers()
            if w.worker_id != dead and w.free_blocks != w.total_blocks
        ]
        if not held:
            return
        assert time.monotonic() < deadline, f"blocks still held: {held}"
        time.sleep(0.2)


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_streams_on_a_dead_or_frozen_decode_worker_resume_on_the_other(expected, fault):
    with (
        Cluster("tiny-llama", 1, 2, worker_args=["--num-kv-blocks", "128"]) as c,
        Client(c.address, security=c.security) as client,
    ):
        victim: list = []

        def strike() -> None:
            _, pid = busiest_decode(c)
            os.kill(pid, getattr(signal, fault))
            wid = next(w.worker_id for w in client.workers() if f"-{pid}-" in w.worker_id)
            victim.extend([wid, pid])

        try:
            results = run_streams(client, strike)
        finally:
            if fault == "SIGSTOP" and victim:
                os.kill(victim[1], signal.SIGCONT)
        for (tokens, (_, reason)), want in zip(results, expected):
            assert tokens == want  # nothing lost, nothing repeated
            assert reason == "length"
        resumed = [timings["resumes"] for _, (timings, _) in results]
        assert sum(resumed) >= 1, resumed  # the busiest worker was serving some
        moved_to = {t["decode_worker"] for _, (t, _) in results if t["resumes"]}
        assert victim[0] not in moved_to, moved_to  # resumed on the other worker
        if fault == "SIGKILL":
            survivors_free(client, dead=victim[0])
        else:  # back from SIGCONT: what it held for the streams taken away is freed
            survivors_free(client, dead="")


def test_a_killed_prefill_worker_is_retried_on_the_other(expected):
    """A reservation whose prefill died keeps its blocks fenced until the push window is over
    (the router's prefill timeout, short here): then every block is back."""
    with (
        Cluster(
            "tiny-llama",
            2,
            1,
            worker_args=["--num-kv-blocks", "128"],
            router_args=["--prefill-timeout", "6"],
        ) as c,
        Client(c.address, security=c.security) as client,
    ):
        prefills = [w.worker_id for w in client.workers() if w.role == "prefill"]
        pid = pid_of(c, prefills[0])
        with ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(client.generate, PROMPTS[i % len(PROMPTS)], **PARAMS) for i in range(16)
            ]
            os.kill(pid, signal.SIGKILL)  # while the first ones prefill
            results = [f.result(timeout=180) for f in futures]
        for i, result in enumerate(results):
            assert result.token_ids == expected[i % len(PROMPTS)]
        late = client.generate(PROMPTS[0], **PARAMS)  # the dead one is skipped now
        assert late.token_ids == expected[0]
        assert late.timings["prefill_worker"] == prefills[1]
        survivors_free(client, dead=prefills[0])
