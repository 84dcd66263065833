"""A worker's KV pool as the transfer layer sees it: where a block of a layer lives, in bytes.

A pool `[*planes, num_blocks, *block]` (see KVCache) is `planes` runs of `num_blocks` blocks:
GQA has 2 planes per layer (K, V), MLA one. Block b of plane p starts at
`(p * num_blocks + b) * block_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.config import ModelConfig
from transfer import KVLayoutSpec


@dataclass(frozen=True)
class PoolGeometry:
    num_blocks: int
    block_bytes: int  # one block of one plane
    planes_per_layer: int

    def offset(self, plane: int, block: int) -> int:
        return (plane * self.num_blocks + block) * self.block_bytes

    def layer_planes(self, layer: int) -> range:
        return range(layer * self.planes_per_layer, (layer + 1) * self.planes_per_layer)

    def tile_indices(self, layer: int, blocks: np.ndarray) -> np.ndarray:
        """Indices of (plane of `layer`, block) tiles when the pool is cut into blocks:
        plane-major, so two pools give matching pairs for matching block lists."""
        planes = np.arange(layer * self.planes_per_layer, (layer + 1) * self.planes_per_layer)
        return (planes[:, None] * self.num_blocks + blocks[None, :]).ravel()


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


@dataclass
class KVEndpoint:
    """A worker's KV pool as the transfer layer sees it: geometry, layout, agent, region."""

    geometry: PoolGeometry
    layout: KVLayoutSpec
    agent: object  # transfer.TransferAgent
    region: int


def kv_endpoint(engine, model_name: str, worker_id: str, transfer: str) -> KVEndpoint:
    """Register `engine`'s KV pool with a new transfer agent named `worker_id`."""
    from transfer import make_agent

    kv = engine.kv_cache
    agent = make_agent(transfer, worker_id)
    return KVEndpoint(
        geometry=pool_geometry(engine.model_config, kv.pool, kv.block_dim),
        layout=layout_spec(model_name, engine.model_config, kv.pool.dtype, kv.block_size),
        agent=agent,
        region=agent.register(kv.pool),
    )


def layout_spec(model_name: str, config: ModelConfig, dtype: torch.dtype, block_size: int):
    return KVLayoutSpec(
        model=f"{config.architecture}:{model_name}",
        dtype=str(dtype).removeprefix("torch."),
        block_size=block_size,
        num_layers=config.num_layers,
        token_shape=tuple(config.kv_token_shape),
    )
