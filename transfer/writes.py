"""Posting one request's KV as WRITEs: the two pools' sides and the block runs between them.

    PoolSide        one end of a push in the pushing agent's terms (geometry, region, tiles)
    HeadRoute       between tensor-parallel groups of different sizes: the heads one pair
                    of ranks moves
    pool_side       our pool as a PoolSide (its region prepared as block tiles once)
    Peers           peers' pools as PoolSides, each peer added and prepared once
    block_runs      pairs of block lists cut into runs consecutive on both sides
    write_layers    one WRITE of some layers' KV of some blocks -> (the transfer, its bytes)

One descriptor per (plane, run of blocks consecutive on both sides): NIXL does not merge
neighbouring prepared tiles, and a 12 KiB tile costs about as much to post as a 1 MiB run.
When no two blocks line up, the prepared tiles are cheaper. A head route's WRITEs move the
route's heads of each token's row, one descriptor per (plane, block, token).

Prefill pushes (prefill/push.py) and decode-to-decode migrations (decode/migrate.py) both
post through here.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from transfer.agent import Desc, Tiles, Transfer, TransferAgent
from transfer.heads import HeadSlice, Route, route_descs, whole_blocks
from transfer.metadata import agent_name
from transfer.wire import PoolGeometry, PoolLayout


@dataclass(frozen=True)
class HeadRoute:
    """A target's share of the heads: its route and the two ranks' head slices."""

    route: Route
    src: HeadSlice
    dst: HeadSlice
    block_size: int

    @property
    def whole(self) -> bool:
        return whole_blocks(self.route, self.src, self.dst)


@dataclass(frozen=True)
class PoolSide:
    """One end of a push in the pushing agent's terms (the peer's region and tiles for the
    remote side)."""

    geometry: PoolGeometry
    region: int
    tiles: Tiles | None  # None: posted as descriptors only (a region for one WRITE)


def pool_side(agent: TransferAgent, layout: PoolLayout, peer: str | None = None) -> PoolSide:
    """A pool (ours when `peer` is None) as the pushing agent names it: its region prepared
    as tiles of one block each."""
    geometry = layout.geometry
    return PoolSide(
        geometry, layout.region, agent.prepare_tiles(peer, layout.region, geometry.block_bytes)
    )


class Peers:
    """The peers one agent pushes to, each added (its metadata loaded) and its pool prepared
    once: `side(key, metadata, layout)` -> (the peer's agent name, its PoolSide).

    Keyed by `key` (a worker's rank) and the agent its metadata names: a worker restarted
    under the same id is a new agent (each start's agent has a name of its own,
    pdserve/cli/serve.py), added beside the old one, never in its place: a batch may hold
    targets of both, and what was handed out for one stays valid while the batch posts.
    The old one goes once unused for `superseded_s` (longer than any push lasts); past
    `capacity` peers, any unused for `idle_s` go too, the longest unused first (workers
    that left)."""

    def __init__(
        self,
        agent: TransferAgent,
        capacity: int = 256,
        idle_s: float = 600.0,
        superseded_s: float = 120.0,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.agent = agent
        self.capacity = capacity
        self.idle_s = idle_s
        self.superseded_s = superseded_s
        self._known: OrderedDict[tuple, _Peer] = OrderedDict()

    def side(self, key, metadata: bytes, layout: PoolLayout) -> tuple[str, PoolSide]:
        name = agent_name(metadata)
        known = self._known.get((key, name))
        if known is None:
            peer = self.agent.add_peer(metadata)
            for (k, _), other in self._known.items():
                other.superseded = other.superseded or k == key  # it restarted as `name`
            known = self._known[(key, name)] = _Peer(peer, pool_side(self.agent, layout, peer))
        known.used = time.monotonic()
        self._known.move_to_end((key, name))
        self._evict(known.used)
        return known.name, known.side

    def _evict(self, now: float) -> None:
        gone = [
            f for f, p in self._known.items() if p.superseded and now - p.used >= self.superseded_s
        ]
        for full, oldest in self._known.items():
            if len(self._known) - len(gone) <= self.capacity or now - oldest.used < self.idle_s:
                break  # (oldest first: the rest were used later)
            if full not in gone:
                gone.append(full)
        for full in gone:
            self._drop(full)

    def _drop(self, full: tuple) -> None:
        peer = self._known.pop(full)
        if peer.side.tiles is not None:
            with contextlib.suppress(Exception):
                self.agent.release_tiles(peer.side.tiles)
        with contextlib.suppress(Exception):  # a peer gone already
            self.agent.remove_peer(peer.name)

    def __len__(self) -> int:
        return len(self._known)


@dataclass
class _Peer:
    name: str
    side: PoolSide
    used: float = 0.0  # time.monotonic() of the last side() that returned it
    superseded: bool = False  # its worker came back as another agent


def block_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Pairs of block lists cut where either side stops being consecutive ->
    rows (src start, dst start, length). One row when both sides are single runs."""
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return np.stack([src[starts], dst[starts], lengths], axis=1).astype(np.int64)


def write_layers(
    agent: TransferAgent,
    peer: str,
    layers: range,
    src: PoolSide,
    dst: PoolSide,
    blocks: tuple[np.ndarray, np.ndarray, np.ndarray],
    notif: bytes,
    heads: HeadRoute | None = None,
) -> tuple[Transfer, int]:
    """Post one WRITE of `layers`' KV for one request -> (it, the bytes it moves); `blocks` =
    (src ids, dst ids, runs from block_runs); `heads`: only that route's heads."""
    src_ids, dst_ids, runs = blocks
    if heads is not None and not heads.whole:
        local, remote = route_descs(
            layers,
            heads.route,
            ((src.geometry, src.region, heads.src), (dst.geometry, dst.region, heads.dst)),
            heads.block_size,
            runs,
        )
        return agent.write(peer, local, remote, notif), sum(d.length for d in local)
    nbytes = len(layers) * src_ids.size * src.geometry.planes_per_layer * src.geometry.block_bytes
    if len(runs) == len(src_ids) and src.tiles is not None:
        local_idx = np.concatenate([src.geometry.tile_indices(x, src_ids) for x in layers])
        remote_idx = np.concatenate([dst.geometry.tile_indices(x, dst_ids) for x in layers])
        xfer = agent.write_tiles(peer, src.tiles, local_idx, dst.tiles, remote_idx, notif)
        return xfer, nbytes
    gs, gd = src.geometry, dst.geometry
    local, remote = [], []
    planes = range(layers.start * gs.planes_per_layer, layers.stop * gs.planes_per_layer)
    for plane in planes:
        for s, d, n in runs.tolist():
            local.append(Desc(src.region, gs.offset(plane, s), n * gs.block_bytes))
            remote.append(Desc(dst.region, gd.offset(plane, d), n * gd.block_bytes))
    return agent.write(peer, local, remote, notif), nbytes
