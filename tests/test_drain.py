"""Live migration in a launched cluster (real processes, NIXL on 127.0.0.1): `Drain` moves
every request off a decode worker while the streams run, and every client still gets the
colocated engine's tokens, none lost or repeated, with no resume (nothing recomputed)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from long_streams import (
    PARAMS,
    PROMPTS,
    all_free,
    busiest_decode,
    colocated,
    drain_rpc,
    streams,
)

from pdserve.bench.probes import registered
from pdserve.bench.prometheus import scrape, total
from pdserve.cli import main as cli_main
from pdserve.client import Client
from pdserve.launch import Cluster


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return colocated()


def test_drain_moves_every_stream_off_a_decode_worker_with_nothing_recomputed(
    expected, capsys, monkeypatch, tmp_path
):
    points = str(tmp_path)  # the streams' slow steps while the drain runs (long_streams.py)
    with (
        Cluster(
            "tiny-llama",
            1,
            2,
            worker_args=["--num-kv-blocks", "512"],
            decode_args=["--failpoints", points],
        ) as c,
        Client(c.address, security=c.security) as client,
    ):
        decodes = [w.worker_id for w in client.workers() if w.role == "decode"]

        def drain():
            wid = busiest_decode(c)
            # the command's own code, in this process: a new interpreter takes seconds to
            # import, and the streams could be over by then
            monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", c.security.cluster_secret or "")
            code = cli_main(["drain", wid, "--router", c.address])
            return wid, (code, capsys.readouterr())

        results, (drained, (code, out)) = streams(client, drain, slow=points)
        assert code == 0, out.err
        said = re.search(
            rf"^{drained} drained: (\d+) moved \((\d+) moves retried\)$", out.out, re.M
        )
        assert said is not None, out.out
        assert int(said[1]) >= 1
        for (tokens, (timings, reason)), want in zip(results, expected):
            assert tokens == want  # nothing lost, nothing repeated
            assert reason == "length"
            assert timings["resumes"] == 0  # moved, never recomputed
        moved = [t for _, (t, _) in results if t["migrations"]]
        assert len(moved) >= int(said[1])
        assert all(t["decode_worker"] != drained for t in moved)
        recomputed = sum(
            total(scrape(c.metrics[n]), "pdserve_decode_recomputed_tokens_total")
            for n in c.names
            if n.startswith("decode")
        )
        assert recomputed == 0
        all_free(client)
        unknown = pdserve_drain(c, "nope")
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr, unknown.stderr
        # the drained worker gets nothing new: a request after the drain runs on the other
        other = next(w for w in decodes if w != drained)
        late = client.generate(PROMPTS[0], **PARAMS)
        assert late.token_ids == expected[0]
        assert late.timings["decode_worker"] == other

        # a decode worker told to stop (SIGTERM) drains itself first: its streams move
        assert drain_rpc(c, drained, undo=True)[-1].done
        stopping: list = []

        def stop_the_busiest():
            wid = busiest_decode(c)
            proc = c.procs[c.names.index(registered(c)[wid])]
            proc.send_signal(signal.SIGTERM)
            stopping.append((wid, proc))
            return proc.wait(timeout=60)  # drained: its streams moved before it stopped

        results, code = streams(client, stop_the_busiest, slow=points)
        ((stopped, proc),) = stopping
        assert code == 0
        for (tokens, (timings, reason)), want in zip(results, expected):
            assert tokens == want and reason == "length"
            assert timings["resumes"] == 0  # moved before it stopped, never recomputed
        moved = [t for _, (t, _) in results if t["migrations"]]
        assert moved and all(t["decode_worker"] != stopped for t in moved)
        all_free(client, dead={stopped})

        # --stop: once nothing is left on it, the router tells it to stop and it exits 0
        last = next(w for w in decodes if w != stopped)
        proc = c.procs[c.names.index(registered(c)[last])]
        done = pdserve_drain(c, last, "--stop")
        assert done.returncode == 0, done.stderr
        assert f"{last} drained: 0 moved" in done.stdout and f"{last} told to stop" in done.stdout
        assert proc.wait(timeout=60) == 0


def test_drain_moves_the_streams_of_a_tensor_parallel_decode_worker(
    expected, monkeypatch, tmp_path
):
    """Both decode workers are TP=2 groups: a drain moves each stream with every rank's
    heads (decode/legs.py), over the router's Migrate, and the clients see the colocated
    engine's tokens, nothing resumed."""
    points = str(tmp_path)
    with (
        Cluster(
            "tiny-llama",
            1,
            2,
            worker_args=["--num-kv-blocks", "512"],
            decode_tp=2,
            decode_args=["--failpoints", points],
        ) as c,
        Client(c.address, security=c.security) as client,
    ):

        def drain():
            wid = busiest_decode(c)
            monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", c.security.cluster_secret or "")
            return wid, cli_main(["drain", wid, "--router", c.address])

        results, (drained, code) = streams(client, drain, slow=points)
        assert code == 0
        for (tokens, (timings, reason)), want in zip(results, expected):
            assert (tokens, reason) == (want, "length")
            assert timings["resumes"] == 0
        moved = [t for _, (t, _) in results if t["migrations"]]
        assert moved and all(t["decode_worker"] != drained for t in moved)
        all_free(client)


def pdserve_drain(cluster, worker_id: str, *flags: str) -> subprocess.CompletedProcess:
    """`pdserve drain` as a user runs it, with the cluster's secret in its environment."""
    cmd = [sys.executable, "-m", "pdserve.cli", "drain", worker_id, "--router", cluster.address]
    cmd += flags
    env = {**os.environ, "PDSERVE_CLUSTER_SECRET": cluster.security.cluster_secret or ""}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


def test_the_pressure_policy_moves_requests_off_a_full_worker_to_one_that_joined(
    expected, tmp_path
):
    """Skewed arrivals: every stream lands on one decode worker (the other is drained, as a
    worker that has not joined yet), whose pool (greedy admission) fills as they grow; once
    the other takes requests again, the router's rebalancer moves streams to it. Every
    client gets the colocated engine's tokens."""
    with (
        Cluster(
            "tiny-llama",
            1,
            2,
            worker_args=["--num-kv-blocks", "160"],
            decode_args=["--admission", "greedy", "--failpoints", str(tmp_path)],
            router_args=["--migrate-policy", "pressure"],
        ) as c,
        Client(c.address, security=c.security) as client,
    ):
        late = next(w.worker_id for w in client.workers() if w.role == "decode")
        assert drain_rpc(c, late)[-1].done  # idle: at once

        def join():  # and the streams run slow until the rebalancer moved one
            assert drain_rpc(c, late, undo=True)[-1].done
            deadline = time.monotonic() + 60
            while not moves(c):
                assert time.monotonic() < deadline, "the rebalancer moved nothing"
                time.sleep(0.05)

        results, _ = streams(client, join, slow=str(tmp_path))
        for (tokens, (_, reason)), want in zip(results, expected):
            assert tokens == want and reason == "length"
        moved = [t for _, (t, _) in results if t["migrations"]]
        assert any(t["decode_worker"] == late for t in moved), moved
        assert moves(c) >= 1
        all_free(client)


def moves(cluster) -> float:
    """The moves the router completed so far."""
    router = scrape(cluster.metrics["router-0"])
    return total(router, "pdserve_router_migrations_total", outcome="completed")
