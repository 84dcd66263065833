"""One rank's shard: its slice of the config (heads, MLP width, vocabulary) and of each
checkpoint tensor.

Megatron-style: column-parallel projections (q/k/v, gate/up, MLA's q_b and kv_b) keep a
slice of their output rows, row-parallel ones (o_proj, down_proj) a slice of their input
columns and are summed over the ranks; the embedding and the LM head keep a slice of the
vocabulary (padded to a multiple of the group size). KV heads are split as the query heads
are; a group wider than the KV heads replicates each KV head over size / num_kv_heads ranks.
MLA's latent KV is one head shared by all query heads: every rank holds all of it (its
projection kv_a_proj_with_mqa and the latent pool are replicated). MoE experts are sharded
the way dense MLPs are (each expert's intermediate width), the router is replicated.
"""

from __future__ import annotations

import dataclasses

import torch

from pdserve.config import ModelConfig


def _check(ok: bool, size: int, what: str, n: int) -> None:
    if not ok:
        raise ValueError(f"tensor_parallel_size: {size} does not divide {what}={n}")


def check_shardable(config: ModelConfig, size: int) -> None:
    """ValueError naming the first dimension `size` ranks cannot split."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {size}")
    if size == 1:
        return
    _check(config.num_heads % size == 0, size, "num_attention_heads", config.num_heads)
    if config.mla is None:
        kv = config.num_kv_heads
        if kv % size and size % kv:
            raise ValueError(
                f"tensor_parallel_size: {size} neither divides nor is a multiple of "
                f"num_key_value_heads={kv}"
            )
    _check(
        config.intermediate_size % size == 0, size, "intermediate_size", config.intermediate_size
    )
    if config.moe is not None:
        m = config.moe.moe_intermediate_size
        _check(m % size == 0, size, "moe_intermediate_size", m)


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The config a rank's layers are built from: its heads, KV heads and MLP widths
    (vocabulary and hidden size stay global; see VocabParallelEmbedding)."""
    check_shardable(config, size)
    if size == 1:
        return config
    moe = config.moe
    if moe is not None:
        moe = dataclasses.replace(moe, moe_intermediate_size=moe.moe_intermediate_size // size)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=max(1, config.num_kv_heads // size),
        intermediate_size=config.intermediate_size // size,
        moe=moe,
    )


def kv_head_range(config: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """[first, last) of the global KV heads rank `rank` of `size` holds (MLA: its one
    latent head, replicated)."""
    if config.mla is not None:
        return 0, 1
    kv = config.num_kv_heads
    if size <= kv:
        per = kv // size
        return rank * per, (rank + 1) * per
    head = rank // (size // kv)
    return head, head + 1


def vocab_shard(vocab_size: int, size: int) -> int:
    """Rows of the vocabulary each rank holds (the last rank's tail is padding)."""
    return -(-vocab_size // size)


def narrow(tensor: torch.Tensor, dim: int, index: int, length: int) -> torch.Tensor:
    """Slice `index` of `length` along `dim`, zero-padded where the tensor ends first."""
    start = index * length
    have = max(0, min(length, tensor.shape[dim] - start))
    piece = tensor.narrow(dim, min(start, tensor.shape[dim]), have)
    if have == length:
        return piece
    shape = list(tensor.shape)
    shape[dim] = length - have
    return torch.cat([piece, tensor.new_zeros(shape)], dim=dim)


@dataclasses.dataclass(frozen=True)
class ShardRule:
    """Checkpoint tensors whose name contains `pattern` (the first rule that matches wins)
    are cut along `dim`; a tensor with no such dim is taken whole (a row-parallel layer's
    bias: see kind "first"). `kind` picks the slice:

        rank    slice `rank` of `size` equal slices (the tensor must split exactly)
        kv      the slice of the rank's KV heads (k and v projections)
        vocab   slice `rank`, the vocabulary padded with zero rows to size slices
        first   rank 0 keeps the whole tensor, the others zeros (a row-parallel bias: the
                sum over the ranks adds it once)
    """

    pattern: str
    dim: int
    kind: str = "rank"


class CheckpointSharder:
    """Cuts global checkpoint tensors to one rank's parameter shapes."""

    def __init__(self, rules: tuple[ShardRule, ...], config: ModelConfig, rank: int, size: int):
        self.rules = rules
        self.rank = rank
        self.size = size
        first = kv_head_range(config, rank, size)[0]
        self.kv_index = first // max(1, config.num_kv_heads // size)  # in units of its slice
        self.kv_slices = min(size, config.num_kv_heads)

    def __call__(self, name: str, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.size == 1:
            return tensor
        for rule in self.rules:
            if rule.pattern not in name or tensor.dim() <= rule.dim:
                continue
            if rule.kind == "first":
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            length = shape[rule.dim]
            if rule.kind == "vocab":
                return narrow(tensor, rule.dim, self.rank, length)
            index, slices = (
                (self.kv_index, self.kv_slices) if rule.kind == "kv" else (self.rank, self.size)
            )
            if tensor.shape[rule.dim] != length * slices:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}: "
                    f"{length * slices} along dim {rule.dim} expected"
                )
            return tensor.narrow(rule.dim, index * length, length)
        return tensor
