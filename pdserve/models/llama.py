"""Llama-family GQA decoder: Llama 2/3, Qwen2 (q/k/v bias), Mistral."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.attention import AttentionMetadata, TorchAttentionBackend
from pdserve.config import ModelConfig
from pdserve.models.base import MLP_RULES, ROW_PARALLEL_RULES, VOCAB_RULES, CausalLM
from pdserve.models.layers import GatedMLP, Linear, RMSNorm
from pdserve.models.rope import RopeTable, RotaryEmbedding
from pdserve.parallel.comm import SINGLE, TPComm
from pdserve.parallel.shard import ShardRule, local_config


class GQAAttention(nn.Module):
    """`config` is the rank's slice under tensor parallelism (its query and KV heads);
    o_proj is row-parallel and its partial sums are added over the ranks."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, comm: TPComm) -> None:
        super().__init__()
        self.comm = comm
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.rotary = rotary

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: RopeTable,  # cos/sin of the tokens' positions
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        backend: TorchAttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(rope, q, k)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        backend.write_kv(k_cache, k, meta)
        backend.write_kv(v_cache, v, meta)
        out = backend.gqa(q, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return self.comm.all_reduce(self.o_proj(out.reshape(t, self.q_size)))


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, comm: TPComm) -> None:
        super().__init__()
        self.self_attn = GQAAttention(config, rotary, comm)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, comm)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, rope, kv_cache, meta, backend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, kv_cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(CausalLM):
    graph_capturable = True
    stacked_rules = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }
    tp_rules = (
        ShardRule(".q_proj.", 0),
        ShardRule(".k_proj.", 0, "kv"),
        ShardRule(".v_proj.", 0, "kv"),
        *ROW_PARALLEL_RULES,
        *MLP_RULES,
        *VOCAB_RULES,
    )

    def __init__(self, config: ModelConfig, comm: TPComm = SINGLE) -> None:
        rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position)
        local = local_config(config, comm.size)
        layers = [LlamaLayer(local, rotary, comm) for _ in range(config.num_layers)]
        super().__init__(config, layers, rotary, comm)

    def shard_sizes(self) -> dict[str, list[int] | int]:
        c = self.local
        kv = c.num_kv_heads * c.head_dim
        return {
            ".qkv_proj.": [c.num_heads * c.head_dim, kv, kv],
            ".gate_up_proj.": 2,
        }
