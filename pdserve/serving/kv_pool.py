"""A worker's KV pool as the transfer layer sees it: registered with the worker's transfer
agent, described to peers as a PoolLayout (handshake + geometry, transfer/wire.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.config import ModelConfig
from pdserve.engine.core import EngineCore
from pdserve.rpc import pdserve_pb2 as pb
from transfer import (
    KV_WIRE_VERSION,
    KVLayoutSpec,
    PoolGeometry,
    PoolLayout,
    TransferAgent,
    check_handshake,
)


@dataclass(frozen=True)
class KVEndpoint:
    agent: TransferAgent
    spec: KVLayoutSpec  # what the pool holds (model, dtype, block size, heads, layers)
    layout: PoolLayout  # what a peer needs: the handshake and where every block lies

    @property
    def geometry(self) -> PoolGeometry:
        return self.layout.geometry

    @property
    def region(self) -> int:
        return self.layout.region

    @property
    def bytes_per_block(self) -> int:
        """One block of every layer plane: what pushing one block moves."""
        return self.geometry.block_bytes * self.geometry.planes_per_layer * self.spec.num_layers

    def check_peer(self, peer: PoolLayout) -> None:
        """HandshakeRefused unless the peer's pool holds what ours holds, in the same bytes."""
        check_handshake(self.spec, peer.wire_version, peer.layout_hash)
        if peer.geometry.block_bytes != self.geometry.block_bytes:
            raise ValueError("dest_layout.block_bytes: the decode pool's blocks differ from ours")
        if peer.geometry.planes_per_layer != self.geometry.planes_per_layer:
            raise ValueError("dest_layout.planes_per_layer: differs from ours")

    def close(self) -> None:
        self.agent.close()


def open_endpoint(core: EngineCore, model_name: str, agent: TransferAgent) -> KVEndpoint:
    """Register the core's KV pool with `agent` (one region for every layer)."""
    pool = core.kv_pool
    spec = layout_spec(model_name, core.model_config, pool.dtype, core.block_size)
    return KVEndpoint(
        agent=agent,
        spec=spec,
        layout=PoolLayout(
            wire_version=KV_WIRE_VERSION,
            layout_hash=spec.layout_hash(),
            geometry=pool_geometry(core.model_config, pool, core.kv_block_dim),
            region=agent.register(pool),
        ),
    )


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
    )


def layout_from_proto(msg: pb.KVLayout) -> PoolLayout:
    """Raises ValueError naming the field when the numbers cannot describe a pool."""
    for name in ("num_blocks", "block_bytes", "planes_per_layer"):
        if getattr(msg, name) <= 0:
            raise ValueError(f"dest_layout.{name}: must be > 0, got {getattr(msg, name)}")
    return PoolLayout(
        wire_version=msg.wire_version,
        layout_hash=msg.layout_hash,
        geometry=PoolGeometry(msg.num_blocks, msg.block_bytes, msg.planes_per_layer),
        region=msg.region,
    )
