"""What one rank holds in memory: its weights (and their packed copies) and its KV pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kv import KVCache


@dataclass(frozen=True)
class RankMemory:
    rank: int
    weight_bytes: int  # the rank's parameters (a tied embedding and head counted once)
    packed_weight_bytes: int  # oneDNN's copies of fp32 CPU weights (pdserve/models/layers.py)
    kv_bytes: int  # the rank's KV pool
    num_blocks: int


def model_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(weights, packed copies) of a loaded model, in bytes."""
    seen, weights, packed = set(), 0, 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weights += p.numel() * p.element_size()
    for m in model.modules():
        t = getattr(m, "packed", None)
        if isinstance(t, torch.Tensor):
            packed += t.numel() * t.element_size()
    return weights, packed


def held_bytes(model: torch.nn.Module) -> int:
    """What a rank's model takes before its KV pool (EngineArgs.memory_per_rank's share)."""
    return sum(model_bytes(model))


def rank_memory(rank: int, model: torch.nn.Module, cache: KVCache) -> RankMemory:
    weights, packed = model_bytes(model)
    return RankMemory(rank, weights, packed, cache.nbytes, cache.num_blocks)
