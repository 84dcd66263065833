"""A worker's KV pool as the transfer layer sees it: registered with the worker's transfer
agent, described to peers as a PoolLayout (handshake + geometry, transfer/wire.py).

A tensor-parallel worker is a group of ranks, each with its own pool (its KV heads of every
block) and its own transfer agent (pdserve/serving/rank_kv.py runs them on ranks 1..n-1):
its endpoint is rank 0's plus `ranks`, what a peer needs of the others. The layout hash is
the whole model's (every rank of either side has the same one); which heads a rank holds
travels beside it (`PoolLayout.heads`), and `routes_to` maps our heads onto a peer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.config import ModelConfig
from pdserve.engine.core import EngineCore
from pdserve.parallel.shard import kv_head_range
from pdserve.rpc import pdserve_pb2 as pb
from transfer import (
    KV_WIRE_VERSION,
    HeadSlice,
    KVLayoutSpec,
    PoolGeometry,
    PoolLayout,
    Route,
    TransferAgent,
    check_handshake,
    head_routes,
)
from transfer.writes import HeadRoute

RANK_ENDPOINT = "pdserve.serving.rank_kv:RankEndpoint"  # the other ranks' extension


@dataclass(frozen=True)
class RankKV:
    """Rank r >= 1 of a tensor-parallel worker as a peer reaches it."""

    agent_metadata: bytes
    layout: PoolLayout


@dataclass(frozen=True)
class KVEndpoint:
    agent: TransferAgent
    spec: KVLayoutSpec  # what the pool holds (model, dtype, block size, heads, layers)
    layout: PoolLayout  # what a peer needs: the handshake and where every block lies
    ranks: tuple[RankKV, ...] = ()  # ranks 1..n-1 of a tensor-parallel worker

    @property
    def layouts(self) -> list[PoolLayout]:
        """Every rank's pool, rank order."""
        return [self.layout, *(r.layout for r in self.ranks)]

    @property
    def geometry(self) -> PoolGeometry:
        return self.layout.geometry

    @property
    def region(self) -> int:
        return self.layout.region

    @property
    def bytes_per_block(self) -> int:
        """One block of every layer plane on every rank: what pushing one block moves."""
        per_layer = sum(g.geometry.block_bytes * g.geometry.planes_per_layer for g in self.layouts)
        return per_layer * self.spec.num_layers

    def routes_to(self, peers: Sequence[PoolLayout]) -> list[Route]:
        """Which of our ranks sends which heads to which of the peer's ranks (transfer/
        heads.py); HandshakeRefused when a peer speaks another wire version, holds another
        model's KV, or its ranks cannot be mapped onto ours; ValueError for geometry that
        contradicts its own head slice."""
        for peer in peers:
            check_handshake(self.spec, peer.wire_version, peer.layout_hash)
        routes = head_routes(
            [heads_of(p, self.spec) for p in self.layouts], [heads_of(p, self.spec) for p in peers]
        )
        mine = heads_of(self.layout, self.spec)
        for j, peer in enumerate(peers):
            if peer.geometry.planes_per_layer != self.geometry.planes_per_layer:
                raise ValueError("dest_layout.planes_per_layer: differs from ours")
            theirs = heads_of(peer, self.spec)
            if peer.geometry.block_bytes * mine.count != self.geometry.block_bytes * theirs.count:
                raise ValueError(
                    f"dest_layout.block_bytes: rank {j}'s blocks differ from ours for its heads"
                )
        return routes

    def head_route(self, route: Route, peers: Sequence[PoolLayout]) -> HeadRoute | None:
        """The heads `route` (one of routes_to(peers)) moves of each token -> None when both
        ranks hold exactly those heads (it moves whole blocks)."""
        src = heads_of(self.layouts[route.src], self.spec)
        heads = HeadRoute(route, src, heads_of(peers[route.dst], self.spec), self.spec.block_size)
        return None if heads.whole else heads

    def close(self) -> None:
        self.agent.close()


def open_endpoint(
    core: EngineCore, model_name: str, agent: TransferAgent, extension: str = RANK_ENDPOINT
) -> KVEndpoint:
    """Register the core's KV pool with `agent` (one region for every layer). Under tensor
    parallelism every other rank installs `extension` (a RankEndpoint or a subclass), opens
    an agent of the same backend and registers its own pool."""
    pool = core.kv_pool
    config, size = core.model_config, core.tp_size
    spec = layout_spec(model_name, config, pool.dtype, core.block_size)
    ranks: tuple[RankKV, ...] = ()
    if size > 1:
        if agent.backend not in ("nixl", "ucxx"):
            raise ValueError(
                f"tensor_parallel_size: {size} ranks need a transfer backend that crosses "
                f"processes (nixl or ucxx), not {agent.backend!r}"
            )
        core.rank_call("extend", extension)
        answers = core.rank_call("endpoint", agent.backend, agent.name, model_name)
        ranks = tuple(RankKV(meta, layout) for meta, layout in answers)
    return KVEndpoint(
        agent=agent,
        spec=spec,
        layout=rank_layout(spec, config, pool, core.kv_block_dim, agent.register(pool), 0, size),
        ranks=ranks,
    )


def rank_layout(
    spec: KVLayoutSpec,
    config: ModelConfig,
    pool: torch.Tensor,
    block_dim: int,
    region: int,
    rank: int,
    size: int,
) -> PoolLayout:
    """Rank `rank` of `size`'s pool as a peer sees it (its heads included)."""
    return PoolLayout(
        wire_version=KV_WIRE_VERSION,
        layout_hash=spec.layout_hash(),
        geometry=pool_geometry(config, pool, block_dim),
        region=region,
        heads=head_slice(config, rank, size),
    )


def total_heads(config: ModelConfig) -> int:
    """KV heads per token on the wire: GQA's KV heads, MLA's one latent."""
    return 1 if config.mla is not None else config.num_kv_heads


def head_slice(config: ModelConfig, rank: int, size: int) -> HeadSlice:
    start, stop = kv_head_range(config, rank, size)
    return HeadSlice(start, stop, total_heads(config), rank, size)


def heads_of(layout: PoolLayout, spec: KVLayoutSpec) -> HeadSlice:
    """The layout's heads; a pool that names none holds them all (no tensor parallelism)."""
    if layout.heads is not None:
        return layout.heads
    shape = spec.token_shape
    return HeadSlice.whole(shape[1] if len(shape) == 3 else 1)


def pool_geometry(config: ModelConfig, kv_pool: torch.Tensor, block_dim: int) -> PoolGeometry:
    planes = 1
    for d in kv_pool.shape[:block_dim]:
        planes *= d
    block_elems = kv_pool[(0,) * (block_dim + 1)].numel()
    return PoolGeometry(
        num_blocks=kv_pool.shape[block_dim],
        block_bytes=block_elems * kv_pool.element_size(),
        planes_per_layer=planes // config.num_layers,
    )


def layout_spec(
    model_name: str, config: ModelConfig, dtype: torch.dtype, block_size: int
) -> KVLayoutSpec:
    return KVLayoutSpec(
        model=f"{config.architecture}:{model_name}",
        dtype=str(dtype).removeprefix("torch."),
        block_size=block_size,
        num_layers=config.num_layers,
        token_shape=tuple(config.kv_token_shape),
    )


def layout_to_proto(layout: PoolLayout) -> pb.KVLayout:
    g = layout.geometry
    return pb.KVLayout(
        wire_version=layout.wire_version,
        layout_hash=layout.layout_hash,
        num_blocks=g.num_blocks,
        block_bytes=g.block_bytes,
        planes_per_layer=g.planes_per_layer,
        region=layout.region,
        **heads_to_proto(layout.heads),
    )


def heads_to_proto(heads: HeadSlice | None) -> dict:
    if heads is None:
        return {}
    return dict(
        head_start=heads.start,
        head_stop=heads.stop,
        total_heads=heads.total,
        tp_rank=heads.rank,
        tp_size=heads.ranks,
    )


def ranks_to_proto(endpoint: KVEndpoint) -> list[pb.RankKV]:
    return [
        pb.RankKV(layout=layout_to_proto(r.layout), agent_metadata=r.agent_metadata)
        for r in endpoint.ranks
    ]


def ranks_from_proto(msgs) -> tuple[RankKV, ...]:
    return tuple(RankKV(m.agent_metadata, layout_from_proto(m.layout)) for m in msgs)


def layout_from_proto(msg: pb.KVLayout) -> PoolLayout:
    """Raises ValueError naming the field when the numbers cannot describe a pool."""
    for name in ("num_blocks", "block_bytes", "planes_per_layer"):
        if getattr(msg, name) <= 0:
            raise ValueError(f"dest_layout.{name}: must be > 0, got {getattr(msg, name)}")
    heads = None
    if msg.tp_size:  # all zero: no tensor parallelism
        heads = HeadSlice(msg.head_start, msg.head_stop, msg.total_heads, msg.tp_rank, msg.tp_size)
    return PoolLayout(
        wire_version=msg.wire_version,
        layout_hash=msg.layout_hash,
        geometry=PoolGeometry(msg.num_blocks, msg.block_bytes, msg.planes_per_layer),
        region=msg.region,
        heads=heads,
    )
