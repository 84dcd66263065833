"""Which KV heads go where between two tensor-parallel groups, and the bytes that carries.

Every rank's pool holds a slice of the KV heads of every block (`HeadSlice`; MLA's latent
is one head that every rank holds whole). A push from a prefill group to a decode group is
a set of `Route`s: each head of each decode rank comes from the first prefill rank that
holds it (a prefill group wider than the KV heads holds some twice: one of them sends).
Equal groups pair rank i with rank i, whole blocks; unequal ones move per-token runs of
heads, because a block is token-major inside ([block_size, heads, head_dim] per plane):

    route_descs(...)   the (local, remote) descriptors of one route for some layers

A pair of groups that cannot be mapped (different head counts, slices that are not one
group) is refused at the handshake with HandshakeRefused, before a byte moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from transfer.agent import Desc
from transfer.wire import HandshakeRefused, PoolGeometry


@dataclass(frozen=True)
class HeadSlice:
    """KV heads [start, stop) of `total`, held by rank `rank` of a group of `ranks`."""

    start: int
    stop: int
    total: int
    rank: int = 0
    ranks: int = 1

    @property
    def count(self) -> int:
        return self.stop - self.start

    @classmethod
    def whole(cls, total: int) -> HeadSlice:
        """A pool of no tensor parallelism: every head."""
        return cls(0, total, total)


@dataclass(frozen=True)
class Route:
    """Heads [first, first + count) of every pushed block: prefill rank `src` -> decode
    rank `dst`."""

    src: int
    dst: int
    first: int
    count: int


def check_group(slices: Sequence[HeadSlice], side: str) -> None:
    """HandshakeRefused unless `slices` are ranks 0..n-1 of one group over one head count."""
    if not slices:
        raise HandshakeRefused(f"the {side} side describes no rank")
    total = slices[0].total
    for i, s in enumerate(slices):
        if (s.rank, s.ranks, s.total) != (i, len(slices), total):
            raise HandshakeRefused(
                f"the {side} side's rank {i} says it is rank {s.rank} of {s.ranks} over "
                f"{s.total} KV heads; expected rank {i} of {len(slices)} over {total}"
            )
        if not 0 <= s.start < s.stop <= total:
            raise HandshakeRefused(f"the {side} side's rank {i} holds heads {s.start}..{s.stop}")


def head_routes(src: Sequence[HeadSlice], dst: Sequence[HeadSlice]) -> list[Route]:
    """Every head of every decode rank, from the first prefill rank that holds it."""
    check_group(src, "prefill")
    check_group(dst, "decode")
    if src[0].total != dst[0].total:
        raise HandshakeRefused(
            f"the prefill side has {src[0].total} KV heads per token, the decode side "
            f"{dst[0].total}"
        )
    routes = []
    for j, d in enumerate(dst):
        h = d.start
        while h < d.stop:
            owner = next((i for i, s in enumerate(src) if s.start <= h < s.stop), None)
            if owner is None:
                raise HandshakeRefused(f"no prefill rank holds KV head {h} (decode rank {j})")
            stop = min(d.stop, src[owner].stop)
            routes.append(Route(owner, j, h, stop - h))
            h = stop
    return routes


def whole_blocks(route: Route, src: HeadSlice, dst: HeadSlice) -> bool:
    """Whether the route moves whole blocks (both ranks hold exactly its heads)."""
    return src.count == dst.count == route.count


def route_descs(
    layers: range,
    route: Route,
    sides: tuple[tuple[PoolGeometry, int, HeadSlice], tuple[PoolGeometry, int, HeadSlice]],
    block_size: int,
    runs: np.ndarray,
) -> tuple[list[Desc], list[Desc]]:
    """(local, remote) descriptors of `route` for `layers`: `sides` = ((geometry, region,
    heads) of the pushing rank, the same of the receiving rank); `runs` = rows (src block,
    dst block, length) as prefill/push.py's block_runs. Whole blocks when the route covers
    both ranks' heads (one descriptor per plane and run), else one per plane, block and
    token: the route's heads of that token's row."""
    (gs, rs, hs), (gd, rd, hd) = sides
    local, remote = [], []
    planes = range(layers.start * gs.planes_per_layer, layers.stop * gs.planes_per_layer)
    if whole_blocks(route, hs, hd):
        for plane in planes:
            for s, d, n in runs.tolist():
                local.append(Desc(rs, gs.offset(plane, s), n * gs.block_bytes))
                remote.append(Desc(rd, gd.offset(plane, d), n * gd.block_bytes))
        return local, remote
    head_bytes = gs.block_bytes // (block_size * hs.count)
    if gd.block_bytes != head_bytes * block_size * hd.count:
        raise HandshakeRefused("the two pools' heads differ in size")
    length = route.count * head_bytes
    src_row, dst_row = hs.count * head_bytes, hd.count * head_bytes
    src_at = (route.first - hs.start) * head_bytes
    dst_at = (route.first - hd.start) * head_bytes
    for plane in planes:
        for s0, d0, n in runs.tolist():
            for b in range(n):
                src_block = gs.offset(plane, s0 + b) + src_at
                dst_block = gd.offset(plane, d0 + b) + dst_at
                for t in range(block_size):
                    local.append(Desc(rs, src_block + t * src_row, length))
                    remote.append(Desc(rd, dst_block + t * dst_row, length))
    return local, remote
