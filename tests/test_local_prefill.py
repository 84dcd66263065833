"""Conditional disaggregation: a short prompt computed by the decode worker that reserved it
(RouterConfig.local_prefill_tokens), on the books (a real engine core's small pool: exact
blocks and check_integrity() after every step) and in a launched cluster (real processes,
NIXL for the prompts that still go to the prefill worker)."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from decode.config import DecodeConfig
from decode.state import DecodeState, UnknownRequest
from pdserve import LLM, SamplingParams, trace
from pdserve.client import Client
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.launch import Cluster
from tests.test_cluster import PROMPTS, colocated, wait_all_blocks_free

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
LONG = list(range(1, 41))  # 40 tokens: 3 blocks of 16
SHORT = [7, 8, 9]


@pytest.fixture
def books():
    args = EngineArgs(block_size=16, num_kv_blocks=8, max_num_batched_tokens=16)
    core, _ = build_engine("tiny-llama", args)
    state = DecodeState(core, DecodeConfig("d", admission="greedy"))
    yield state
    core.close()


def step(state: DecodeState):
    core = state.core
    plan = core.begin_step()
    assert plan is not None, "nothing ran"
    out = core.end_step(plan, core.run(plan))
    state.check_integrity()
    return plan.batch, out


def test_a_prompt_started_here_is_computed_beside_the_batch_in_its_reserved_blocks(books):
    state = books
    expected = [
        o.token_ids for o in LLM("tiny-llama").generate([SHORT, LONG], GREEDY)
    ]  # the colocated engine's
    state.reserve("short", SHORT, GREEDY)
    state.start_here("short")
    state.check_integrity()
    batch, out = step(state)  # its whole prompt, and its first token
    assert [(r.request_id, len(c.token_ids)) for r, c in zip(batch.requests, batch.chunks)] == [
        ("short", 3)
    ]
    tokens = {"short": [t.token for t in out.tokens], "long": []}
    long_blocks = state.reserve("long", LONG, GREEDY).block_ids
    assert len(long_blocks) == 3 and state.stats().free_blocks == 8 - 1 - 3
    state.start_here("long")
    # the budget is 16 tokens a step: the decoding request goes first, the prompt takes the
    # rest, in its reserved blocks (no other block taken) until its last token samples
    chunks = []
    while len(tokens["long"]) < 1:
        batch, out = step(state)
        assert batch.requests[0].request_id == "short"
        chunks.append([len(c.token_ids) for c in batch.chunks])
        for t in out.tokens:
            tokens[t.request_id].append(t.token)
    assert chunks == [[1, 15], [1, 15], [1, 10]]
    assert state.core.kv_of("long")[0] == long_blocks
    while state.core.has_unfinished:
        _, out = step(state)
        for t in out.tokens:
            tokens[t.request_id].append(t.token)
    assert [tokens["short"], tokens["long"]] == expected
    assert state.stats().free_blocks == 8


def test_a_decoder_admitted_later_goes_ahead_of_a_prompt_still_computed_here(books):
    """The step's token budget goes to the running list in order: a prompt computed here
    ahead of a request whose KV was pushed would take all of it, step after step."""
    state = books
    core = state.core
    state.reserve("long", LONG, GREEDY)
    state.start_here("long")
    assert core.computing_context("long")
    state.reserve("pushed", SHORT, GREEDY)
    pushed = state.reservations.get("pushed").request
    first = core.prefill([pushed])[0]  # its KV in its blocks, as a prefill worker's push
    state.start("pushed", first)
    batch, _ = step(state)
    assert [(r.request_id, len(c.token_ids)) for r, c in zip(batch.requests, batch.chunks)] == [
        ("pushed", 1),
        ("long", 15),
    ]
    while core.computing_context("long"):
        step(state)
    assert core.kv_of("long")[1] == len(LONG)  # computed, its first token sampled


def test_only_a_held_reservation_starts_here(books):
    state = books
    with pytest.raises(UnknownRequest):
        state.start_here("never-reserved")
    state.reserve("a", SHORT, GREEDY)
    state.release("a", unpushed=True)  # no push was ever posted: its blocks back at once
    assert state.stats().free_blocks == 8
    with pytest.raises(UnknownRequest):
        state.start_here("a")
    state.check_integrity()


def metric(address: str, name: str, **labels: str) -> float:
    """The sum of a series' samples at `address`/metrics, of those with `labels` if given."""
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(body)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_a_cluster_computes_short_prompts_on_the_decode_worker():
    """Prompts of at most 20 tokens on the decode worker, the others on the prefill worker:
    the colocated engine's tokens either way, traces that say where the prompt ran, every
    block back."""
    limit = 20
    expected = colocated("tiny-llama")
    here = [len(p) <= limit for p in PROMPTS]
    assert 0 < sum(here) < len(PROMPTS)
    with Cluster(
        "tiny-llama",
        1,
        1,
        worker_args=["--num-kv-blocks", "64"],
        local_prefill_tokens=limit,
    ) as cluster:
        client = Client(cluster.address)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(
                pool.map(
                    lambda p: client.generate(p, max_tokens=10, temperature=0, ignore_eos=True),
                    PROMPTS,
                )
            )
        assert [r.token_ids for r in results] == expected
        for r, local in zip(results, here):
            t, names = r.timings, {s.name for s in r.trace}
            assert t["decode_worker"].startswith("decode-")
            assert 0 < t["prefill_s"] <= t["ttft_s"] <= t["e2e_s"]
            assert t["tpot_s"] > 0
            if local:
                assert t["prefill_worker"] == t["decode_worker"]
                assert "decode.prefill" in names and "rpc.prefill" not in names
                stages = [s.name for s in trace.stages(r.trace)]
                assert stages == [
                    "router.queue",
                    "decode.reserve",
                    "rpc.start",
                    "decode.admission",
                    "decode.run",
                    "router.stream",
                ]
                # the first token was sampled in a decode step: one step more than remote
                steps = [s for s in r.trace if s.name == "decode.step"]
                assert len(steps) >= len(r.token_ids)
            else:
                assert t["prefill_worker"].startswith("prefill-")
                assert "decode.prefill" not in names and "rpc.prefill" in names
        # one token, ended by its first: the stream's only message is the end
        one = client.generate(PROMPTS[0], max_tokens=1, temperature=0, ignore_eos=True)
        assert one.token_ids == expected[0][:1] and one.finish_reason == "length"
        # a stream cancelled while the decode worker decodes it: blocks back
        stream = client.stream(SHORT, max_tokens=500, temperature=0, ignore_eos=True)
        next(stream)
        stream.close()
        wait_all_blocks_free(client)
        counted = {
            "router": metric(cluster.metrics["router-0"], "pdserve_router_local_prefills_total"),
            "decode": metric(cluster.metrics["decode-0"], "pdserve_decode_local_prefills_total"),
        }
        assert counted == {"router": sum(here) + 2, "decode": sum(here) + 2}
        client.close()
