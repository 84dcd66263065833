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


def block_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Pairs of block lists cut where either side stops being consecutive ->
    rows (src start, dst start, length). One row when both sides are single runs."""
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return np.stack([src[starts], dst[starts], lengths], axis=1).astype(np.int64)


@dataclass(frozen=True)
class PoolSide:
    """One end of a push: the pool's geometry, its region id and its prepared tiles, all in
    the pushing agent's terms (the peer's region and tiles for the remote side)."""

    geometry: PoolGeometry
    region: int
    tiles: object  # transfer.Tiles


def write_layers(
    agent, peer: str, layers: range, src: PoolSide, dst: PoolSide, blocks, notif: bytes
):
    """Post one WRITE of `layers`' KV for one request; `blocks` = (src ids, dst ids, runs from
    block_runs). One descriptor per (plane, run of blocks consecutive on both sides): NIXL
    does not merge neighbouring prepared tiles, and a 12 KiB tile costs about as much to post
    as a 1 MiB run. When no two blocks line up, the prepared tiles are cheaper."""
    from transfer import Desc

    src_ids, dst_ids, runs = blocks
    if len(runs) == len(src_ids):
        local_idx = np.concatenate([src.geometry.tile_indices(x, src_ids) for x in layers])
        remote_idx = np.concatenate([dst.geometry.tile_indices(x, dst_ids) for x in layers])
        return agent.write_tiles(peer, src.tiles, local_idx, dst.tiles, remote_idx, notif)
    gs, gd = src.geometry, dst.geometry
    local, remote = [], []
    planes = range(layers.start * gs.planes_per_layer, layers.stop * gs.planes_per_layer)
    for plane in planes:
        for s, d, n in runs.tolist():
            local.append(Desc(src.region, gs.offset(plane, s), n * gs.block_bytes))
            remote.append(Desc(dst.region, gd.offset(plane, d), n * gd.block_bytes))
    return agent.write(peer, local, remote, notif)


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
