"""Live migration in a launched cluster (real processes, NIXL on 127.0.0.1): `Drain` moves
every request off a decode worker while the streams run, and every client still gets the
colocated engine's tokens, none lost or repeated, with no resume (nothing recomputed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve import LLM, SamplingParams
from pdserve.bench.probes import busiest, registered
from pdserve.bench.prometheus import scrape, total
from pdserve.cli import main as cli_main
from pdserve.client import Client, build_request, timings_of
from pdserve.launch import Cluster

MAX_NEW = 1000  # streams that last seconds: the drain starts while they run
PROMPTS = [[(11 * i + j) % 300 + 3 for j in range(20 + 37 * i)] for i in range(6)]
PARAMS = dict(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    params = SamplingParams(**PARAMS)
    return [o.token_ids for o in LLM("tiny-llama").generate(PROMPTS, params)]


def streams(client: Client, on_started):
    started = [0] * len(PROMPTS)

    def one(i: int):
        tokens, final = [], None
        for msg in client.stub.Generate(build_request(PROMPTS[i], PARAMS), timeout=180):
            tokens.extend(msg.token_ids)
            started[i] = len(tokens)
            if msg.finished:
                final = timings_of(msg.timings), msg.finish_reason
        return tokens, final

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(one, i) for i in range(len(PROMPTS))]
        deadline = time.monotonic() + 60
        while not all(started):
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.01)
        out = on_started()
        return [f.result(timeout=180) for f in futures], out


def all_free(client: Client, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while held := [w for w in client.workers() if w.free_blocks != w.total_blocks]:
        assert time.monotonic() < deadline, f"blocks still held: {held}"
        time.sleep(0.2)


def test_drain_moves_every_stream_off_a_decode_worker_with_nothing_recomputed(
    expected, capsys, monkeypatch
):
    with (
        Cluster("tiny-llama", 1, 2, worker_args=["--num-kv-blocks", "512"]) as c,
        Client(c.address, security=c.security) as client,
    ):
        decodes = [w.worker_id for w in client.workers() if w.role == "decode"]

        def drain():
            # the decode worker running the most streams now (its /metrics)
            deadline = time.monotonic() + 30
            while True:
                name, _ = busiest(c, "decode")
                if total(scrape(c.metrics[name]), "pdserve_decode_running") > 0:
                    break
                assert time.monotonic() < deadline, "no decode worker runs a request"
                time.sleep(0.01)
            wid = next(w for w, n in registered(c).items() if n == name)
            # the command's own code, in this process: a new interpreter takes seconds to
            # import, and the streams could be over by then
            monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", c.security.cluster_secret or "")
            code = cli_main(["drain", wid, "--router", c.address])
            return wid, (code, capsys.readouterr())

        results, (drained, (code, out)) = streams(client, drain)
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


def pdserve_drain(cluster, worker_id: str) -> subprocess.CompletedProcess:
    """`pdserve drain` as a user runs it, with the cluster's secret in its environment."""
    cmd = [sys.executable, "-m", "pdserve.cli", "drain", worker_id, "--router", cluster.address]
    env = {**os.environ, "PDSERVE_CLUSTER_SECRET": cluster.security.cluster_secret or ""}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
