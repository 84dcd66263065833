"""KV handoff between tensor-parallel groups: which heads go where (exact routes), the
bytes of every route land in exactly the decode rank's head slice of exactly the reserved
blocks, layouts that cannot be mapped are refused, and launched clusters P(TP=2)->D(TP=1),
P(TP=1)->D(TP=2), P(TP=2)->D(TP=2) give the colocated engine's greedy tokens and free every
block; a rank that dies (decode or prefill) takes its worker out of service."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from pdserve.serving.kv_pool import head_slice
from pdserve.weights.presets import TINY_CONFIGS
from transfer import HandshakeRefused, HeadSlice, PoolGeometry, Route, head_routes, make_agent
from transfer.loopback import LoopbackFabric
from transfer.writes import HeadRoute, PoolSide, block_runs, write_layers

sys.path.insert(0, os.path.dirname(__file__))
from procs import wait_gone  # noqa: E402
from test_cluster import MAX_NEW, PROMPTS, colocated, wait_all_blocks_free  # noqa: E402

DEADLINE_S = 60.0


def group(total: int, size: int) -> list[HeadSlice]:
    """Ranks of a group of `size` over `total` KV heads, as the engine cuts them."""
    config = dataclasses.replace(
        TINY_CONFIGS["tiny-llama"], num_heads=4 * total, num_kv_heads=total
    )
    return [head_slice(config, r, size) for r in range(size)]


# -- routes ----------------------------------------------------------------------------------
def test_routes_pair_equal_groups_rank_by_rank():
    assert head_routes(group(2, 2), group(2, 2)) == [Route(0, 0, 0, 1), Route(1, 1, 1, 1)]


def test_routes_between_unequal_groups():
    assert head_routes(group(4, 1), group(4, 2)) == [Route(0, 0, 0, 2), Route(0, 1, 2, 2)]
    assert head_routes(group(4, 2), group(4, 1)) == [Route(0, 0, 0, 2), Route(1, 0, 2, 2)]
    assert head_routes(group(4, 4), group(4, 2)) == [
        Route(0, 0, 0, 1),
        Route(1, 0, 1, 1),
        Route(2, 1, 2, 1),
        Route(3, 1, 3, 1),
    ]


def test_replicated_heads_are_sent_once_and_received_by_every_replica():
    # prefill TP=4 over 2 KV heads: ranks 0, 1 hold head 0 and ranks 2, 3 head 1
    assert head_routes(group(2, 4), group(2, 1)) == [Route(0, 0, 0, 1), Route(2, 0, 1, 1)]
    # decode TP=4 over 2 KV heads: every replica gets its head
    assert head_routes(group(2, 1), group(2, 4)) == [
        Route(0, 0, 0, 1),
        Route(0, 1, 0, 1),
        Route(0, 2, 1, 1),
        Route(0, 3, 1, 1),
    ]


def test_mla_latent_goes_whole_from_the_first_prefill_rank_to_every_decode_rank():
    latent = [HeadSlice(0, 1, 1, r, 2) for r in range(2)]
    assert head_routes(latent, latent) == [Route(0, 0, 0, 1), Route(0, 1, 0, 1)]


def test_layouts_that_cannot_be_mapped_are_refused():
    with pytest.raises(HandshakeRefused, match="4 KV heads per token, the decode side 2"):
        head_routes(group(4, 2), group(2, 2))
    with pytest.raises(HandshakeRefused, match="rank 1 says it is rank 0 of 2"):
        head_routes([HeadSlice(0, 1, 2, 0, 2), HeadSlice(1, 2, 2, 0, 2)], group(2, 1))
    with pytest.raises(HandshakeRefused, match="no prefill rank holds KV head 1"):
        head_routes([HeadSlice(0, 1, 2, 0, 1)], group(2, 1))
    with pytest.raises(HandshakeRefused, match="describes no rank"):
        head_routes([], group(2, 1))


# -- bytes ------------------------------------------------------------------------------------
LAYERS, HEAD_DIM = 3, 4


def pool_of(heads: HeadSlice, full: torch.Tensor | None, blocks: int, bs: int) -> torch.Tensor:
    """A rank's GQA pool [layers, 2, blocks, bs, its heads, D]: its slice of `full`, or
    zeros (a decode rank's)."""
    if full is not None:
        return full[..., heads.start : heads.stop, :].contiguous()
    return torch.zeros(LAYERS, 2, blocks, bs, heads.count, HEAD_DIM)


def geometry(pool: torch.Tensor) -> PoolGeometry:
    block_bytes = pool[0, 0, 0].numel() * pool.element_size()
    return PoolGeometry(pool.shape[2], block_bytes, 2)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "heads,p,d", [(2, 1, 2), (2, 2, 1), (2, 2, 2), (4, 4, 2), (4, 1, 4), (2, 4, 1), (2, 1, 4)]
)
def test_each_route_writes_exactly_its_heads_of_the_reserved_blocks(heads, p, d, block_size):
    g = torch.Generator().manual_seed(heads * 100 + p * 10 + d)
    src_blocks, dst_blocks = 9, 11
    full = torch.randn(LAYERS, 2, src_blocks, block_size, heads, HEAD_DIM, generator=g)
    src_heads, dst_heads = group(heads, p), group(heads, d)
    src_pools = [pool_of(h, full, src_blocks, block_size) for h in src_heads]
    dst_pools = [pool_of(h, None, dst_blocks, block_size) for h in dst_heads]
    fabric = LoopbackFabric()
    senders = [make_agent("loopback", f"p{i}", fabric=fabric) for i in range(p)]
    receivers = [make_agent("loopback", f"d{j}", fabric=fabric) for j in range(d)]
    src_ids, dst_ids = np.array([3, 4, 5, 8, 0]), np.array([1, 2, 3, 7, 10])
    blocks = (src_ids, dst_ids, block_runs(src_ids, dst_ids))
    try:
        src_regions = [a.register(t) for a, t in zip(senders, src_pools)]
        dst_regions = [b.register(t) for b, t in zip(receivers, dst_pools)]
        routes = head_routes(src_heads, dst_heads)
        for k, route in enumerate(routes):
            a, i, j = senders[route.src], route.src, route.dst
            peer = a.add_peer(receivers[j].metadata())
            gs, gd = geometry(src_pools[i]), geometry(dst_pools[j])
            local = PoolSide(
                gs, src_regions[i], a.prepare_tiles(None, src_regions[i], gs.block_bytes)
            )
            remote = PoolSide(
                gd, dst_regions[j], a.prepare_tiles(peer, dst_regions[j], gd.block_bytes)
            )
            hr = HeadRoute(route, src_heads[i], dst_heads[j], block_size)
            xfer, nbytes = write_layers(
                a, peer, range(LAYERS), local, remote, blocks, f"n{k}".encode(), hr
            )
            xfer.wait()
            assert nbytes == LAYERS * 2 * len(src_ids) * block_size * route.count * HEAD_DIM * 4
        for j, h in enumerate(dst_heads):
            expected = torch.zeros_like(dst_pools[j])
            expected[:, :, dst_ids] = full[:, :, src_ids][..., h.start : h.stop, :]
            assert torch.equal(dst_pools[j], expected), f"decode rank {j}"
    finally:
        for agent in senders + receivers:
            agent.close()


# -- launched clusters ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model,prefill_tp,decode_tp,push",
    [
        ("tiny-llama", 2, 1, "layerwise"),
        ("tiny-llama", 1, 2, "after"),
        ("tiny-llama", 2, 2, "layerwise"),
        ("tiny-deepseek", 2, 2, "after"),
    ],
)
def test_tensor_parallel_clusters_match_the_colocated_engine(model, prefill_tp, decode_tp, push):
    from pdserve.client import Client
    from pdserve.launch import Cluster

    expected = colocated(model)
    with Cluster(
        model,
        worker_args=["--num-kv-blocks", "64"],
        prefill_args=["--kv-push", push],
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
    ) as cluster:
        pids = [p.pid for p in cluster.procs]
        ranks = [int(x) for pid in pids for x in _children(pid)]
        assert len(ranks) == (prefill_tp - 1) + (decode_tp - 1)
        client = Client(cluster.address)
        got = [
            client.generate(p, max_tokens=MAX_NEW, temperature=0, ignore_eos=True).token_ids
            for p in PROMPTS
        ]
        assert got == expected
        for name, ranks_of in (("prefill-0", prefill_tp), ("decode-0", decode_tp)):
            text = _metrics(cluster.metrics[name])
            held = [line for line in text.splitlines() if line.startswith("pdserve_rank_memory")]
            assert len(held) == 3 * ranks_of, held  # weights, packed, kv of every rank
        # a cancelled stream frees its blocks on every rank too (one allocator: rank 0's)
        stream = client.stream(PROMPTS[2], max_tokens=400, temperature=0, ignore_eos=True)
        next(stream)
        stream.close()  # cancels the RPC: router -> decode Release
        wait_all_blocks_free(client)
        client.close()
    for pid in pids + ranks:
        wait_gone(pid)


def _metrics(address: str) -> str:
    from urllib.request import urlopen

    with urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read().decode()


def _children(pid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return out.stdout.split()


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_dead_rank_takes_its_worker_out_of_service(role):
    """The group goes (its worker exits 70, its other ranks die with it) and the router
    serves every request on the other worker of that role."""
    from pdserve.client import Client
    from pdserve.launch import Cluster

    expected = colocated("tiny-llama")[:3]
    counts, tp = ((1, 2), dict(decode_tp=2)) if role == "decode" else ((2, 1), dict(prefill_tp=2))
    with Cluster("tiny-llama", *counts, worker_args=["--num-kv-blocks", "32"], **tp) as cluster:
        worker = cluster.procs[cluster.names.index(f"{role}-0")]
        (rank1,) = _children(worker.pid)
        os.kill(int(rank1), 9)
        assert worker.wait(DEADLINE_S) == 70  # out of service at once, and says why
        wait_gone(int(rank1))
        with Client(cluster.address) as client:
            got = [
                client.generate(p, max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
                for p in PROMPTS[:3]
            ]
        assert [r.token_ids for r in got] == expected
        survivor = _worker_id(cluster, f"{role}-1")
        assert {r.timings[f"{role}_worker"] for r in got} == {survivor}


def _worker_id(cluster, name: str) -> str:
    """The worker id a launched process registered with (its --worker-id or its default)."""
    pid = cluster.procs[cluster.names.index(name)].pid
    return next(w for w in _registered(cluster) if f"-{pid}-" in w)


def _registered(cluster) -> list[str]:
    from pdserve.client import Client

    with Client(cluster.address) as client:
        return [w.worker_id for w in client.workers()]


# -- in-process workers (their ranks are processes), real NIXL -------------------------------
def _blocks_of_every_rank(core, block_ids: list[int]) -> list[torch.Tensor]:
    """[layers, 2, n, bs, heads of the rank, D] of each rank, rank order."""
    ids = torch.tensor(block_ids)
    own = core.kv_pool.index_select(core.kv_block_dim, ids)
    return [own, *(torch.from_numpy(b) for b in core.rank_call("blocks", block_ids))]


@pytest.mark.parametrize("p,d", [(2, 1), (1, 2), (2, 2)])
def test_pushed_kv_lands_byte_for_byte_in_each_decode_ranks_head_slice(p, d):
    from workers import decode_worker, destination, drain, prefill_worker

    from pdserve import LLM, SamplingParams
    from pdserve.engine.args import EngineArgs

    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    base = dict(block_size=16, num_kv_blocks=32)
    prefill = prefill_worker(
        "tiny-llama", f"p-tp{p}{d}", "nixl", EngineArgs(**base, tensor_parallel_size=p)
    )
    decode = decode_worker(
        "tiny-llama", f"d-tp{p}{d}", "nixl", EngineArgs(**base, tensor_parallel_size=d)
    )
    try:
        prompt = list(range(3, 60))  # 57 tokens: 4 blocks, the last one partial
        reserved = decode.reserve("r1", prompt, greedy, lease_s=30)
        result = prefill.submit("r1", prompt, greedy, destination(decode, reserved)).result(60)
        assert result.transfer_bytes == 4 * decode.endpoint.bytes_per_block
        # its blocks stay cached after the push: released (and committed) by the prefill
        # loop right after it answered, so looked for until then
        deadline = time.monotonic() + 10
        while len(src_ids := prefill.core.shared_blocks(prompt)) < 3:
            assert time.monotonic() < deadline, "the prefill blocks were never cached"
            time.sleep(0.01)
        assert len(src_ids) == 3  # the full ones (the partial last is not cached)
        heads = decode.endpoint.layouts
        # the prefill group's KV, every head: its ranks' slices side by side
        sent = torch.cat(_blocks_of_every_rank(prefill.core, src_ids), dim=-2)
        got = _blocks_of_every_rank(decode.core, reserved.block_ids[:3])
        for j, (layout, blocks) in enumerate(zip(heads, got)):
            h = layout.heads
            want = sent[..., h.start : h.stop, :]
            assert torch.equal(blocks, want), f"decode rank {j} (heads {h.start}..{h.stop})"
        tokens, reason = drain(decode.start("r1", result.first_token))
        expected = LLM("tiny-llama", block_size=16).generate([prompt], greedy)[0].token_ids
        assert (tokens, reason) == (expected, "length")
        decode.check_integrity()
        assert decode.stats().free_blocks == 32
        # a reservation whose lease runs out after its push arrived frees its blocks at once
        again = decode.reserve("r2", prompt, greedy, lease_s=0.3, push_window_s=30)
        prefill.submit("r2", prompt, greedy, destination(decode, again)).result(60)
        deadline = time.monotonic() + DEADLINE_S
        while decode.stats().free_blocks < 32 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decode.stats().free_blocks == 32
        decode.check_integrity()
    finally:
        prefill.close()
        decode.close()
