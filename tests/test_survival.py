"""Requests that survive their workers: launched clusters on 127.0.0.1 (real processes, NIXL)
under concurrent greedy streams while a worker is SIGKILLed or SIGSTOPped mid-stream. Every
request completes with the colocated engine's tokens (none lost, none repeated), and the
survivors hold no block afterwards."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve import LLM, SamplingParams, failpoints
from pdserve.bench.probes import leaks, pid_of, registered, spill_dirs, whole
from pdserve.client import Client, build_request, timings_of
from pdserve.launch import Cluster, Supervisor

MAX_NEW = 160
PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(8)]
PARAMS = dict(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    params = SamplingParams(**PARAMS)
    return [o.token_ids for o in LLM("tiny-llama").generate(PROMPTS, params)]


def run_streams(client: Client, on_started=None) -> list:
    """All PROMPTS at once; `on_started()` once every stream has its first tokens (None:
    no wait; in a small pool most streams queue for room behind the first ones)."""
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
        while on_started is not None and not all(started):
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.01)
        if on_started is not None:
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


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_streams_on_a_dead_or_frozen_decode_worker_resume_on_the_other(expected, fault, tmp_path):
    """The decode worker that hands a stream its fourth token is SIGKILLed or SIGSTOPped
    right there (a failpoint: the victim is sure to hold a stream with most of its tokens
    to come, which a strike timed from the outside cannot promise on a busy machine). Other
    requests may be mid-push to it then: their reservations stay fenced until the push
    window is over (the router's prefill timeout, short here), then every block is back."""
    points = str(tmp_path)
    with (
        Cluster(
            "tiny-llama",
            1,
            2,
            worker_args=["--num-kv-blocks", "128"],
            decode_args=["--failpoints", points],
            router_args=["--prefill-timeout", "6"],
        ) as c,
        Client(c.address, security=c.security) as client,
    ):
        worker_of = {pid_of(c, name): wid for wid, name in registered(c).items()}
        failpoints.arm(points, "any", "decode.stream", fault)
        try:
            results = run_streams(client)
        finally:
            hit = failpoints.fired(points, "any", "decode.stream")
            if fault == "stop" and hit is not None:
                os.kill(hit[0], signal.SIGCONT)
        assert hit is not None, "no decode worker streamed a fourth token"
        victim = worker_of[hit[0]]
        for (tokens, (_, reason)), want in zip(results, expected):
            assert tokens == want  # nothing lost, nothing repeated
            assert reason == "length"
        resumed = [timings["resumes"] for _, (timings, _) in results]
        assert sum(resumed) >= 1, resumed  # the struck stream at least
        moved_to = {t["decode_worker"] for _, (t, _) in results if t["resumes"]}
        assert victim not in moved_to, moved_to  # resumed on the other worker
        if fault == "kill":
            survivors_free(client, dead=victim)
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
        pid = pid_of(c, registered(c)[prefills[0]])
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


def test_a_decode_worker_killed_mid_spill_leaves_nothing_behind(expected, tmp_path):
    """SIGKILL at the exact moment a decode worker starts spilling a preempted request to
    its disk tier (a failpoint, pdserve/failpoints.py): every stream completes with the
    colocated engine's tokens, the restarted worker removes the dead one's spill directory,
    and no block, spill entry or file is left on any worker."""
    points, spill = tmp_path / "fp", tmp_path / "spill"
    points.mkdir()
    spill.mkdir()
    decode_args = ["--num-kv-blocks", "16", "--spill-host-blocks", "0", "--spill-cxl-blocks", "0"]
    # greedy admission lets in what must be preempted (and spilled): the default admits no
    # further than the demand's expected peak, exact for these fixed lengths
    decode_args += ["--admission", "greedy"]
    with (
        Cluster(
            "tiny-llama",
            1,
            2,
            worker_args=["--failpoints", str(points)],
            decode_args=[*decode_args, "--spill-dir", str(spill)],
            prefill_args=["--num-kv-blocks", "128"],
        ) as c,
        Client(c.address, security=c.security) as client,
    ):
        failpoints.arm(str(points), "any", "kv.spill", "kill")
        results = run_streams(client)
        hit = failpoints.fired(str(points), "any", "kv.spill")
        assert hit is not None, "no request was spilled: the pools are too large to test this"
        dead_pid = hit[0]
        victim = next(p for p in c.procs if p.pid == dead_pid)  # a decode worker of ours
        assert victim.wait(timeout=10) == -signal.SIGKILL
        for (tokens, (_, reason)), want in zip(results, expected):
            assert tokens == want and reason == "length"
        assert sum(t["resumes"] for _, (t, _) in results) >= 1
        supervisor = Supervisor(c, log=lambda line: None)
        assert whole(c, supervisor, 1, 2, 120)
        assert dead_pid not in spill_dirs(str(spill)).values()  # removed at the restart
        assert leaks(c, supervisor, 30, str(spill)) == dict(
            blocks=0, spill_blocks=0, fenced=0, spill_files=0, stale_dirs=0
        )
        assert client.generate(PROMPTS[0], **PARAMS).token_ids == expected[0]  # serves again


def test_streams_go_on_through_a_router_restart(expected):
    """pdserve launch's supervisor restarts a SIGKILLed router on its port, the workers
    register with it again, and every stream in flight goes on: the SDK sends each request
    to the new router as a continuation of the tokens it has (pdserve/client.py), so every
    client gets the colocated engine's tokens, none lost or repeated."""
    with (
        Cluster("tiny-llama", 1, 1, worker_args=["--num-kv-blocks", "128"]) as c,
        Client(c.address, security=c.security) as client,
    ):
        supervisor = Supervisor(c, log=lambda line: None)
        old_router = c.procs[0].pid
        started = [False] * len(PROMPTS)

        def one(i: int):
            tokens, calls, served = [], [], set()
            for msg in client.messages(PROMPTS[i], calls.append, timeout_s=180, **PARAMS):
                tokens.extend(msg.token_ids)
                served.add(len(calls))  # a continuation that reached no router brings none
                started[i] = True
                final = msg
            return tokens, final.finish_reason, len(served) - 1

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(one, i) for i in range(len(PROMPTS))]
            deadline = time.monotonic() + 60
            while not all(started):
                assert time.monotonic() < deadline, "the streams never started"
                time.sleep(0.01)
            os.kill(old_router, signal.SIGKILL)
            # a stream can end before the kill (on a loaded machine the first ones finish
            # while the last ones start): it had no router to lose. None goes on before the
            # supervisor's next step brings the router back.
            ended_before = [f.done() for f in futures]
            assert sum(ended_before) <= len(PROMPTS) // 2, "too few streams in flight"
            while not all(f.done() for f in futures):  # the supervisor brings it back
                assert time.monotonic() < deadline + 120, "the streams never ended"
                supervisor.step()
                time.sleep(0.05)
            results = [f.result() for f in futures]
        assert c.procs[0].pid != old_router
        for (tokens, reason, reconnects), want, ended in zip(results, expected, ended_before):
            assert tokens == want and reason == "length"
            assert reconnects == (0 if ended else 1)  # each one in flight went on once
        survivors_free(client, dead="")
