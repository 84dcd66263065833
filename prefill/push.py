"""Pushing a batch's KV into the decode workers' reserved blocks over the transfer agent.

    Destination     where one request's KV goes: the decode worker's pool (PoolLayout), its
                    agent metadata and the reserved blocks (the first `cached_blocks` of
                    which it already holds: they are not pushed)
    BatchPush       the WRITEs of one batch: `layers(range)` posts one WRITE per request for
                    those layers (the last carries the request id as its notification),
                    `wait()` until all are DONE, `spans()` for the trace, `release()`

One descriptor per (plane, run of blocks consecutive on both sides): NIXL does not merge
neighbouring prepared tiles, and a 12 KiB tile costs about as much to post as a 1 MiB run.
When no two blocks line up, the prepared tiles are cheaper.

Between tensor-parallel groups of different sizes a target carries its head route
(transfer/heads.py): its WRITEs move the route's heads of each token's row, one descriptor
per (plane, block, token), and its notification names its part of the push.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pdserve.serving.kv_pool import RankKV
from pdserve.trace import Span, now
from transfer import (
    Desc,
    HeadSlice,
    PoolGeometry,
    PoolLayout,
    Route,
    Tiles,
    Transfer,
    TransferAgent,
    TransferFailed,
    XferState,
    route_descs,
)
from transfer.heads import whole_blocks


@dataclass(frozen=True)
class Destination:
    worker_id: str
    agent_metadata: bytes
    pool: PoolLayout  # of the decode worker (its rank 0)
    block_ids: list[int]
    cached_blocks: int = 0  # leading blocks the decode worker already holds: not pushed
    fence: int = 0  # the reservation's fencing token: the notification carries it
    ranks: tuple[RankKV, ...] = ()  # a tensor-parallel decode worker's ranks 1..n-1

    @property
    def pools(self) -> list[PoolLayout]:
        return [self.pool, *(r.layout for r in self.ranks)]

    def rank_metadata(self, rank: int) -> bytes:
        return self.agent_metadata if rank == 0 else self.ranks[rank - 1].agent_metadata


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
    tiles: Tiles


@dataclass(frozen=True)
class PushTarget:
    """One request of a batch: whose blocks go where."""

    peer: str  # the decode worker's agent name
    remote: PoolSide
    src: np.ndarray  # our blocks, after the destination's cached ones
    dst: np.ndarray  # its blocks, the same count
    notif: bytes  # sent with the last layer's WRITE
    # time.monotonic() after which no WRITE is posted for it, and by which every posted one
    # is complete or given up: the decode worker may hand its blocks to someone else once
    # the router's push window (which contains the caller's deadline) is over
    post_by: float = float("inf")
    done_by: float = float("inf")
    heads: HeadRoute | None = None  # None: every head, whole blocks

    @property
    def runs(self) -> np.ndarray:
        return block_runs(self.src, self.dst)


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
    if len(runs) == len(src_ids):
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


class BatchPush:
    """The WRITEs of one batch, with the wall-clock time each push (one layer, or all
    layers at once) was posted and first seen complete (polled at every later layer boundary
    and while waiting for the tail)."""

    def __init__(
        self,
        agent: TransferAgent,
        local: PoolSide,
        targets: list[PushTarget],
        num_layers: int,
        worker: str,
    ) -> None:
        self.agent, self.local, self.targets = agent, local, targets
        self.num_layers, self.worker = num_layers, worker
        self._runs = [t.runs for t in targets]
        self._posted: list[tuple[int, float, list[Transfer]]] = []  # (layer or -1 for all, ...)
        self._done_at: dict[int, float] = {}
        self.nbytes = 0
        self.abandoned: set[int] = set()  # targets past their deadline: nothing more posted

    def layers(self, layers: range) -> None:
        """Post one WRITE per request for `layers` (none for a request past its deadline,
        then or before: it is abandoned)."""
        last = layers.stop == self.num_layers
        posted = []
        t = time.monotonic()
        for i, (target, runs) in enumerate(zip(self.targets, self._runs)):
            if i in self.abandoned or target.post_by <= t:
                self.abandoned.add(i)
                continue
            xfer, nbytes = write_layers(
                self.agent,
                target.peer,
                layers,
                self.local,
                target.remote,
                (target.src, target.dst, runs),
                target.notif if last else b"",
                target.heads,
            )
            posted.append(xfer)
            self.nbytes += nbytes
        self._posted.append((layers.start if len(layers) == 1 else -1, now(), posted))
        self.poll()

    def poll(self) -> bool:
        """True when every posted write is complete; raises TransferFailed on a failed one."""
        for layer, _, transfers in self._posted:
            if layer in self._done_at:
                continue
            states = [t.state() for t in transfers]
            if XferState.FAILED in states:
                raise TransferFailed(f"the push of layer {layer} failed")
            if all(s is XferState.DONE for s in states):
                self._done_at[layer] = now()
        return len(self._done_at) == len(self._posted)

    def wait(self, timeout_s: float, poll_s: float) -> None:
        """Until every posted WRITE is complete: at most `timeout_s`, and never past the
        `done_by` of a request that has WRITEs in flight (raises TransferFailed)."""
        posted = [t.done_by for i, t in enumerate(self.targets) if i not in self.abandoned]
        deadline = min([time.monotonic() + timeout_s, *posted])
        while not self.poll():
            if time.monotonic() > deadline:
                raise TransferFailed("KV push not complete by its deadline")
            time.sleep(poll_s)

    def spans(self) -> list[Span]:
        return [
            Span(
                "push.layer" if layer >= 0 else "push.all",
                start,
                self._done_at[layer],
                self.worker,
                layer,
            )
            for layer, start, _ in self._posted
        ]

    def release(self) -> None:
        for _, _, transfers in self._posted:
            for xfer in transfers:
                xfer.release()
