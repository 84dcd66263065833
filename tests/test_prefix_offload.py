"""Offloaded prefix blocks: full blocks evicted from the device prefix cache go to the spill
tiers with their hashes, and a later prompt with the same prefix reloads them instead of
computing them. Outputs never change; check_integrity() after every step."""

from __future__ import annotations

import logging
import os

import pytest

from pdserve import SamplingParams
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.engine.core import EngineCore
from pdserve.kv.offload import Prefix

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SHARED = list(range(40, 56))  # 16 tokens: 4 full blocks of 4
FILLERS = [[100 + 7 * i + j for j in range(30)] for i in range(4)]  # evict everything


def engine(tmp_path, **kw) -> EngineCore:
    kw = {"block_size": 4, "num_kv_blocks": 12, "spill_dir": str(tmp_path), **kw}
    return build_engine("tiny-llama", EngineArgs(**kw))[0]


def run(core: EngineCore, prompts, params=GREEDY):
    reqs = [core.make_request(p, params) for p in prompts]
    for req in reqs:
        core.add(req)
    outs = {}
    while core.has_unfinished:
        for done in core.step().finished:
            outs[done.request_id] = done
        core.check_integrity()
    return [outs[r.request_id] for r in reqs]


def offloaded(core: EngineCore):
    return core.stats().pool.offloaded


@pytest.fixture(scope="module")
def reference():
    roomy = build_engine("tiny-llama", EngineArgs(block_size=4, num_kv_blocks=256))[0]
    return lambda prompts, params=GREEDY: [o.output_token_ids for o in run(roomy, prompts, params)]


def test_an_evicted_prefix_is_reloaded_instead_of_computed(tmp_path, reference):
    eng = engine(tmp_path, prefix_offload=True)
    alloc, offload = eng.kv.allocator, eng.kv.offload
    a, b = SHARED + [1, 2, 3], SHARED + [9, 8]
    hashes = alloc.prefix_hashes(a, 4)
    assert run(eng, [a])[0].output_token_ids == reference([a])[0]
    assert all(h in alloc.hash_to_block for h in hashes)  # cached on the device
    for filler in FILLERS:  # one at a time: each needs most of the 12-block pool
        run(eng, [filler])
    assert not any(h in alloc.hash_to_block for h in hashes)  # evicted ...
    assert all(offload.has_prefix(h) for h in hashes)  # ... to the host tier, hashes kept
    assert all(Prefix(h) in offload.tiers[0] for h in hashes)
    reloaded = offloaded(eng).prefix_blocks_reloaded
    out = run(eng, [b])[0]
    assert out.output_token_ids == reference([b])[0]
    assert out.metrics.cached_prompt_tokens == 16  # all 4 shared blocks, none computed
    assert offloaded(eng).prefix_blocks_reloaded - reloaded == 4
    eng.close()


def test_without_offload_the_evicted_prefix_is_computed_again(tmp_path):
    eng = engine(tmp_path)
    run(eng, [SHARED + [1, 2, 3]])
    for filler in FILLERS:
        run(eng, [filler])
    assert run(eng, [SHARED + [9, 8]])[0].metrics.cached_prompt_tokens == 0
    assert eng.kv.offload is None


def test_a_recomputed_request_reloads_its_offloaded_prefix(tmp_path, reference):
    """Recompute preemption: the victim's full blocks stay cached when freed, are offloaded
    when reused, and come back when the victim is admitted again."""
    prompts = [[i + 5] * 20 for i in range(6)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = reference(prompts, params)
    plain = engine(tmp_path, num_kv_blocks=26)
    assert [o.output_token_ids for o in run(plain, prompts, params)] == expected
    offload = engine(tmp_path, num_kv_blocks=26, prefix_offload=True)
    outs = run(offload, prompts, params)
    assert [o.output_token_ids for o in outs] == expected
    assert sum(o.metrics.preemptions for o in outs) > 0
    assert offloaded(offload).prefix_blocks_reloaded > 0
    redo, plain_redo = offload.stats().recomputed_tokens, plain.stats().recomputed_tokens
    assert redo == sum(o.metrics.recomputed_tokens for o in outs)
    assert redo < plain_redo  # reloaded blocks are not computed again
    offload.close()


def test_spills_of_preempted_requests_win_over_cached_prefixes(tmp_path, reference):
    """A host tier of 24 blocks (these requests park at most 20 at once): offloaded prefixes
    fill it first, and a preempted request's spill makes room by dropping the oldest of them
    instead of falling back to recompute."""
    prompts = [[i + 5] * 20 for i in range(6)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    eng = engine(
        tmp_path, num_kv_blocks=26, preemption="swap", prefix_offload=True, spill_host_blocks=24
    )
    for filler in FILLERS + [[f + 1 for f in filler] for filler in FILLERS]:
        run(eng, [filler])
    assert offloaded(eng).prefixes >= 20  # the tier is (nearly) full of cached prefixes
    outs = run(eng, prompts, params)
    assert [o.output_token_ids for o in outs] == reference(prompts, params)
    assert sum(o.metrics.spills for o in outs) == sum(o.metrics.preemptions for o in outs) > 0
    assert offloaded(eng).failed_parks == 0 and eng.stats().recomputed_tokens == 0
    assert offloaded(eng).prefixes_dropped_for_parks > 0  # the oldest made room for the spills
    eng.close()


def test_a_corrupt_offloaded_prefix_is_computed_never_used(tmp_path, reference, caplog):
    eng = engine(
        tmp_path,
        preemption="tiered",
        prefix_offload=True,
        spill_host_blocks=0,
        spill_cxl_blocks=0,  # every offloaded block goes to disk
    )
    run(eng, [SHARED + [1, 2, 3]])
    for filler in FILLERS:
        run(eng, [filler])
    disk = eng.kv.offload.tiers[-1]
    disk.flush()
    second = eng.kv.allocator.prefix_hashes(SHARED, 2)[1]
    with open(disk._entries[Prefix(second)].path, "r+b") as f:  # the second shared block
        byte = f.read(1)[0]
        f.seek(0)
        f.write(bytes([byte ^ 0x40]))
    caplog.set_level(logging.WARNING)
    out = run(eng, [SHARED + [9, 8]])[0]
    assert out.output_token_ids == reference([SHARED + [9, 8]])[0]
    assert out.metrics.cached_prompt_tokens == 4  # the first block only; the rest computed
    assert "fails its checksum" in caplog.text
    assert not eng.kv.offload.has_prefix(second)
    directory = disk.directory
    eng.close()
    assert not os.path.exists(directory)


def test_prefix_offload_needs_prefix_caching():
    with pytest.raises(ValueError, match="prefix_offload: needs enable_prefix_caching"):
        EngineArgs(prefix_offload=True, enable_prefix_caching=False)


def test_workers_reuse_cached_and_offloaded_prefixes_on_both_sides():
    """Real workers (NIXL, one process), both with --prefix-offload and small pools. The
    prefill worker evicts the shared prefix to its host tier and reloads it; the decode
    worker shares its cached copy at Reserve, later reloads its offloaded copy, and either
    way the prefill worker pushes only the blocks after the prefix."""
    from workers import decode_worker, destination, drain, prefill_worker

    from pdserve import LLM

    shared = list(range(3, 51))  # 48 tokens: 3 full blocks of 16
    prefill = prefill_worker(
        "tiny-llama", "p-offload", "nixl", EngineArgs(num_kv_blocks=8, prefix_offload=True)
    )
    decode = decode_worker(
        "tiny-llama", "d-offload", "nixl", EngineArgs(num_kv_blocks=10, prefix_offload=True)
    )
    block_bytes = decode.endpoint.bytes_per_block
    reference = LLM("tiny-llama", block_size=16)
    try:

        def handoff(rid: str, prompt: list[int]) -> tuple[list[int], int, int]:
            """-> (tokens, blocks the decode worker already had, bytes pushed)."""
            reserved = decode.reserve(rid, prompt, GREEDY, lease_s=30)
            result = prefill.submit(rid, prompt, GREEDY, destination(decode, reserved)).result(60)
            tokens, _ = drain(decode.start(rid, result.first_token))
            decode.check_integrity()
            prefill.check_integrity()
            return tokens, reserved.cached_blocks, result.transfer_bytes

        def expected(prompt: list[int]) -> list[int]:
            return reference.generate([prompt], GREEDY)[0].token_ids

        first = shared + [1, 2, 3]  # 4 blocks
        assert handoff("a", first) == (expected(first), 0, 4 * block_bytes)
        second = shared + [9, 8, 7]
        # decode had the prefix cached on its device: 3 blocks shared, 1 pushed
        assert handoff("b", second) == (expected(second), 3, block_bytes)
        for i in range(3):  # 100-token prompts: 7 blocks each, on both sides
            handoff(f"fill-{i}", [200 + 3 * i + j for j in range(100)])
        hashes = prefill.core.kv.allocator.prefix_hashes(shared, 3)
        for worker in (prefill, decode):  # evicted from both devices, offloaded on both
            kv = worker.core.kv
            assert all(kv.offload.has_prefix(h) for h in hashes)
            assert not any(h in kv.allocator.hash_to_block for h in hashes)

        def reloads():
            return [offloaded(w.core).prefix_blocks_reloaded for w in (prefill, decode)]

        before = reloads()
        third = shared + [5, 5]
        assert handoff("c", third) == (expected(third), 3, block_bytes)
        assert [now - r for now, r in zip(reloads(), before)] == [3, 3]
    finally:
        prefill.close()
        decode.close()


def test_a_cluster_pushes_only_what_the_decode_worker_lacks():
    """Through the router (gRPC Reserve -> Prefill with dest_cached_blocks): the second
    prompt with a shared 3-block prefix moves one block of KV instead of four."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from pdserve import LLM
    from pdserve.client import Client
    from pdserve.launch import Cluster

    def received(address: str) -> float:
        body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        return sum(
            s.value
            for f in text_string_to_metric_families(body)
            for s in f.samples
            if s.name == "pdserve_transfer_bytes_total" and s.labels["direction"] == "received"
        )

    shared = list(range(3, 51))
    prompts = [shared + [1, 2, 3], shared + [9, 8, 7]]
    params = dict(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in LLM("tiny-llama").generate(prompts, SamplingParams(**params))]
    with Cluster(
        "tiny-llama", 1, 1, worker_args=["--num-kv-blocks", "64", "--prefix-offload"]
    ) as cluster:
        decode = next(a for k, a in cluster.metrics.items() if k.startswith("decode"))
        client = Client(cluster.address)
        moved = []
        for prompt, want in zip(prompts, expected):
            before = received(decode)
            assert client.generate(prompt, **params).token_ids == want
            moved.append(received(decode) - before)
        assert moved[1] * 4 == moved[0] > 0  # 1 block instead of 4
        client.close()


def test_request_ids_cannot_collide_with_offloaded_prefixes(tmp_path, reference):
    """Parked KV and offloaded prefixes live under typed keys: requests named exactly like
    the prefix entries of the old string namespace ('prefix:<hash>') park and come back
    while those prefixes are offloaded, and nothing mixes up (it used to crash the spill
    or trip check_integrity: 'spilled KV without its request')."""
    eng = engine(
        tmp_path, num_kv_blocks=26, preemption="swap", prefix_offload=True, spill_host_blocks=512
    )
    run(eng, [SHARED + [1, 2, 3]])
    for filler in FILLERS + [[f + 1 for f in filler] for filler in FILLERS]:
        run(eng, [filler])
    hashes = eng.kv.allocator.prefix_hashes(SHARED, 4)
    assert all(eng.kv.offload.has_prefix(h) for h in hashes)
    prompts = [[i + 5] * 20 for i in range(6)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ids = [f"prefix:{h:032x}" for h in hashes] + ["prefix:", "req-5"]
    reqs = [eng.make_request(p, params, request_id=rid) for p, rid in zip(prompts, ids)]
    for req in reqs:
        eng.add(req)
    outs, parked = {}, set()
    while eng.has_unfinished:
        out = eng.step()
        parked.update(out.parked)
        outs.update({d.request_id: d.output_token_ids for d in out.finished})
        eng.check_integrity()
    assert parked & set(ids[:4]), "the test needs a prefix-named request to be parked"
    assert [outs[rid] for rid in ids] == reference(prompts, params)
    assert all(eng.kv.offload.has_prefix(h) for h in hashes)  # the prefixes are intact
    assert eng.stats().recomputed_tokens == 0
    eng.close()
