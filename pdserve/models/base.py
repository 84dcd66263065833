"""The decoder skeleton every model family shares: embed -> layers -> norm -> lm_head.

A model works on a packed batch: `input_ids [T]` and `positions [T]` for all tokens of the
step, `kv_caches[i]` the pool of layer i, and `AttentionMetadata` describing the sequences.
Parameter names follow Hugging Face checkpoints, except the fusions `StackedLoader` maps.

Under tensor parallelism (`comm` a group of several ranks) each rank builds its layers from
its slice of the config (`local_config`) and loads its slice of every checkpoint tensor by
the family's `tp_rules` (pdserve/parallel/shard.py); `compute_logits` then returns the full
logits on rank 0 only (None on the others).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kernels import decode_ops_cpu, small_gemm_cpu
from pdserve.attention import AttentionMetadata, TorchAttentionBackend
from pdserve.config import ModelConfig
from pdserve.models.layers import Linear, RMSNorm, StackedLoader, VocabParallelEmbedding
from pdserve.models.rope import RotaryEmbedding
from pdserve.parallel.comm import SINGLE, TPComm
from pdserve.parallel.shard import CheckpointSharder, ShardRule, local_config

# Every family's embedding and head: slices of the vocabulary.
VOCAB_RULES = (ShardRule("embed_tokens.", 0, "vocab"), ShardRule("lm_head.", 0, "vocab"))
# Row-parallel projections: a slice of the input columns; the bias is added once (rank 0).
ROW_PARALLEL_RULES = tuple(
    rule
    for proj in (".o_proj.", ".down_proj.")
    for rule in (ShardRule(f"{proj}bias", 0, "first"), ShardRule(proj, 1))
)
MLP_RULES = (ShardRule(".gate_proj.", 0), ShardRule(".up_proj.", 0))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[nn.Module], comm: TPComm) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    # checkpoint sub-name -> (fused sub-name, shard); see StackedLoader
    stacked_rules: dict[str, tuple[str, int]] = {}
    # how each checkpoint tensor is cut for a tensor-parallel rank (first match wins)
    tp_rules: tuple[ShardRule, ...] = ()
    # a decode step's forward launches the same kernels whatever the data (no host reads of
    # device values): it can be captured in a CUDA graph (pdserve/engine/cuda_graphs.py)
    graph_capturable = False

    def __init__(
        self,
        config: ModelConfig,
        layers: list[nn.Module],
        rotary: RotaryEmbedding,
        comm: TPComm = SINGLE,
    ) -> None:
        super().__init__()
        self.config = config
        self.local = local_config(config, comm.size)  # what this rank's layers hold
        self.comm = comm
        self.rotary = rotary  # shared by every layer's attention
        self.model = DecoderModel(config, layers, comm)
        self.lm_head = Linear(config.hidden_size, self.model.embed_tokens.rows, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def shard_sizes(self) -> dict[str, list[int] | int]:
        return {}

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: TorchAttentionBackend,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # hidden states [T, hidden]
        """`on_layer_done(i)` runs as soon as layer i's KV is in the pool (layer-wise push)."""
        h = self.model.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, h.dtype)
        for i, (layer, cache) in enumerate(zip(self.model.layers, kv_caches)):
            h = layer(h, rope, cache, meta, backend)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] fp32 logits for sampling (None on ranks other than 0)."""
        logits = self.comm.gather_cols(self.lm_head(hidden).float())
        if logits is None or logits.shape[-1] == self.config.vocab_size:
            return logits
        return logits[:, : self.config.vocab_size]  # the last slice's padding rows

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        sharder = CheckpointSharder(self.tp_rules, self.config, self.comm.rank, self.comm.size)
        loader = StackedLoader(self, self.stacked_rules, self.shard_sizes(), sharder)
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # shares model.embed_tokens.weight
            if self.skip_weight(name):
                continue
            loader.load(name, tensor)
        loader.check_complete()

    def skip_weight(self, name: str) -> bool:
        # rotary tables are recomputed; DeepSeek-V3's multi-token-prediction layers are unused
        return "rotary_emb" in name or self.is_mtp_weight(name)

    def is_mtp_weight(self, name: str) -> bool:
        if not name.startswith("model.layers."):
            return False
        return int(name.split(".")[2]) >= self.config.num_layers

    def after_load(self) -> None:
        """Derive inference-only tensors from loaded weights (after the final dtype/device):
        fp32 CPU models lay every Linear's weight out in panels (or for oneDNN), and build
        the C kernels of their products and element-wise steps now rather than in their
        first step (see layers.Linear, layers.RMSNorm)."""
        fp32_cpu = False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
                w = module.weight
                fp32_cpu = fp32_cpu or (w.device.type == "cpu" and w.dtype == torch.float32)
        if fp32_cpu:
            decode_ops_cpu.available()
            if Linear.native_rows:
                small_gemm_cpu.available()
