"""Pushing one layer of KV between two pools: descriptor runs and prepared tiles move exactly
the named blocks of exactly that layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transfer import PoolGeometry, make_agent
from transfer.loopback import LoopbackFabric
from transfer.writes import PoolSide, block_runs, write_layers


def test_block_runs_cut_where_either_side_breaks():
    src = np.array([4, 5, 6, 7, 9, 10])
    dst = np.array([0, 1, 3, 4, 5, 6])
    assert block_runs(src, dst).tolist() == [[4, 0, 2], [6, 3, 2], [9, 5, 2]]
    assert block_runs(np.arange(3), np.arange(3) + 8).tolist() == [[0, 8, 3]]
    assert block_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)).shape == (0, 3)


@pytest.mark.parametrize("backend", ["loopback", "nixl", "ucxx"])
@pytest.mark.parametrize(
    "src_ids,dst_ids",
    [
        ([0, 1, 2, 3], [4, 5, 6, 7]),  # one run: 2 descriptors (K and V planes)
        ([0, 1, 5, 6], [2, 3, 9, 10]),  # two runs
        ([7, 2, 9], [1, 8, 4]),  # nothing lines up: prepared tiles
    ],
)
def test_write_layers_moves_exactly_those_layers_blocks(backend, src_ids, dst_ids):
    layers, planes, nblocks, block_elems = 3, 2, 12, 24
    src_pool = torch.randn(layers * planes, nblocks, block_elems)
    dst_pool = torch.zeros(layers * planes, 14, block_elems)  # pools may differ in size
    options = {"fabric": LoopbackFabric()} if backend == "loopback" else {}
    a = make_agent(backend, f"{backend}-wl-a", **options)
    b = make_agent(backend, f"{backend}-wl-b", **options)
    try:
        ra, rb = a.register(src_pool), b.register(dst_pool)
        peer = a.add_peer(b.metadata())
        bb = block_elems * 4
        gs, gd = PoolGeometry(nblocks, bb, planes), PoolGeometry(14, bb, planes)
        src_side = PoolSide(gs, ra, a.prepare_tiles(None, ra, bb))
        dst_side = PoolSide(gd, rb, a.prepare_tiles(peer, rb, bb))
        s, d = np.array(src_ids), np.array(dst_ids)
        blocks = (s, d, block_runs(s, d))
        write_layers(a, peer, range(1, 2), src_side, dst_side, blocks, b"l1")[0].wait()
        expected = torch.zeros_like(dst_pool)
        for plane in (2, 3):  # layer 1's K and V planes only
            expected[plane, d] = src_pool[plane, s]
        assert torch.equal(dst_pool, expected)
        write_layers(a, peer, range(0, 3), src_side, dst_side, blocks, b"all")[0].wait()
        expected[:, d] = src_pool[:, s]  # every layer
        assert torch.equal(dst_pool, expected)
    finally:
        a.close()
        b.close()
