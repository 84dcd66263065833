"""Long greedy streams against a launched cluster, for the live-migration tests: they last
seconds, so that a drain or a move starts while they run."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from pdserve import LLM, SamplingParams, failpoints
from pdserve.bench.probes import busiest, registered
from pdserve.bench.prometheus import scrape, total
from pdserve.client import Client, build_request, timings_of
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.serving.drain import drain

MAX_NEW = 1000  # streams that last seconds: the drain starts while they run
PROMPTS = [[(11 * i + j) % 300 + 3 for j in range(20 + 37 * i)] for i in range(6)]
PARAMS = dict(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def colocated() -> list[list[int]]:
    """The colocated engine's tokens for PROMPTS."""
    params = SamplingParams(**PARAMS)
    return [o.token_ids for o in LLM("tiny-llama").generate(PROMPTS, params)]


SLOW_STEP = "pause 0.01 repeat"  # while on_started runs: a stream of MAX_NEW lasts >= 10 s


def streams(
    client: Client,
    on_started,
    request_ids: list[str] | None = None,
    ended: list[float] | None = None,
    slow: str | None = None,
):
    """PROMPTS streamed at once (under `request_ids`: the router's ids else); once each has
    a token, `on_started()` -> ([(tokens, (timings, finish reason))], what it returned).
    `ended`, if given, gets each stream's time.time() at its final message. `slow`: the
    decode workers' failpoint directory; every decode step is made 10 ms longer until
    on_started() returns, so that the streams outlast what it does however fast this
    machine decodes (a drain's moves found streams of a fast machine over)."""
    started = [0] * len(PROMPTS)
    ids = request_ids or [""] * len(PROMPTS)
    if ended is not None:
        ended[:] = [0.0] * len(PROMPTS)

    def one(i: int):
        tokens, final = [], None
        request = build_request(PROMPTS[i], PARAMS, request_id=ids[i])
        for msg in client.stub.Generate(request, timeout=180):
            tokens.extend(msg.token_ids)
            started[i] = len(tokens)
            if msg.finished:
                final = timings_of(msg.timings), msg.finish_reason
                if ended is not None:
                    ended[i] = time.time()
        return tokens, final

    if slow is not None:
        failpoints.arm(slow, "any", "decode.step", SLOW_STEP)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        try:
            futures = [pool.submit(one, i) for i in range(len(PROMPTS))]
            deadline = time.monotonic() + 60
            while not all(started):
                assert time.monotonic() < deadline, "the streams never started"
                time.sleep(0.01)
            out = on_started()
        finally:
            if slow is not None:
                failpoints.disarm(slow, "any", "decode.step")
        return [f.result(timeout=180) for f in futures], out


def all_free(client: Client, timeout_s: float = 30.0, dead: frozenset | set = frozenset()):
    """Until every worker but the `dead` ones holds no block."""
    deadline = time.monotonic() + timeout_s
    while held := [
        w for w in client.workers() if w.worker_id not in dead and w.free_blocks != w.total_blocks
    ]:
        assert time.monotonic() < deadline, f"blocks still held: {held}"
        time.sleep(0.2)


def busiest_decode(cluster) -> str:
    """The id of the decode worker running the most streams now (its /metrics)."""
    deadline = time.monotonic() + 30
    while True:
        name, _ = busiest(cluster, "decode")
        if total(scrape(cluster.metrics[name]), "pdserve_decode_running") > 0:
            return next(w for w, n in registered(cluster).items() if n == name)
        assert time.monotonic() < deadline, "no decode worker runs a request"
        time.sleep(0.01)


def drain_rpc(cluster, worker_id: str, undo: bool = False) -> list[pb.DrainProgress]:
    """The router's Drain (or its undo) as a cluster member calls it -> every message."""
    return list(drain(cluster.address, cluster.security, worker_id, undo, timeout_s=180))
