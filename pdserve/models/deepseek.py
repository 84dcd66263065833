"""DeepSeek-V2/V3 decoder: multi-head latent attention (MLA) and mixture of experts.

MLA caches one latent row per token, `[c_kv | k_pe]` (kv_lora_rank + rope_dim values),
instead of per-head K and V. Attention runs in the absorbed form: W_UK (the key half of
kv_b_proj) is folded into the query and W_UV (the value half) applied after attention,
so the per-head keys and values are never materialised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.attention import AttentionMetadata, TorchAttentionBackend
from pdserve.config import MLAConfig, ModelConfig, MoEConfig
from pdserve.models.base import MLP_RULES, ROW_PARALLEL_RULES, VOCAB_RULES, CausalLM
from pdserve.models.layers import GatedMLP, Linear, RMSNorm
from pdserve.models.rope import RopeTable, RotaryEmbedding, yarn_mscale
from pdserve.parallel.comm import SINGLE, TPComm
from pdserve.parallel.shard import ShardRule, local_config


class MLAAttention(nn.Module):
    """`config` is the rank's slice under tensor parallelism: its query heads (q, kv_b and
    o_proj are sharded by head); the latent projection and the latent cache are whole on
    every rank (one KV head, shared by all query heads)."""

    def __init__(
        self, config: ModelConfig, mla: MLAConfig, rotary: RotaryEmbedding, comm: TPComm
    ) -> None:
        super().__init__()
        self.comm = comm
        self.mla = mla
        self.num_heads = config.num_heads
        hidden = config.hidden_size
        q_out = config.num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(
            hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=config.qkv_bias
        )
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(
            mla.kv_lora_rank, config.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = Linear(config.num_heads * mla.v_head_dim, hidden, bias=config.o_bias)
        self.rotary = rotary
        scale = mla.qk_head_dim**-0.5
        rope = config.rope
        if rope.rope_type != "default" and rope.mscale_all_dim:
            scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        self.scale = scale
        self.w_uk: torch.Tensor | None = None  # [H, nope, r], set by absorb()
        self.w_uv_t: torch.Tensor | None = None  # [H, r, v]

    def absorb(self) -> None:
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
        self.w_uk = w[:, : m.qk_nope_head_dim].contiguous()
        self.w_uv_t = w[:, m.qk_nope_head_dim :].transpose(1, 2).contiguous()
        self.kv_b_proj.drop_packed()  # read here, never multiplied: no packed copy

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: RopeTable,  # cos/sin of the tokens' positions
        latent_cache: torch.Tensor,  # [num_blocks, block_size, r + dr]
        meta: AttentionMetadata,
        backend: TorchAttentionBackend,
    ) -> torch.Tensor:
        assert self.w_uk is not None and self.w_uv_t is not None, "absorb() after loading"
        m, t = self.mla, x.shape[0]
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        c_kv = self.kv_a_layernorm(c_kv)  # [T, r]
        q_pe, k_pe = self.rotary(rope, q_pe, k_pe.unsqueeze(1))  # [T, H, dr], [T, 1, dr]
        backend.write_kv(latent_cache, torch.cat([c_kv, k_pe.squeeze(1)], dim=-1), meta)
        # q_latent[t, h] = q_nope[t, h] @ W_UK[h]: [H, T, nope] @ [H, nope, r] -> [T, H, r]
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        out_latent = backend.mla(q_latent, q_pe, latent_cache, meta, self.scale)  # [T, H, r]
        out = torch.bmm(out_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1)  # [T, H, v]
        return self.comm.all_reduce(self.o_proj(out.reshape(t, self.num_heads * m.v_head_dim)))


class MoEGate(nn.Module):
    """Router. Scores in fp32; V2 routes on softmax scores, V3 on sigmoid + correction bias."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.zeros(moe.n_routed_experts, hidden))
        if moe.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] fp32, expert ids [T, k])."""
        m = self.moe
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        if m.topk_method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            group_scores = self._grouped(choice).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            choice = choice.masked_fill(~self._group_mask(group_scores), float("-inf"))
            ids = choice.topk(m.num_experts_per_tok, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if m.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            if m.topk_method == "group_limited_greedy":
                group_scores = self._grouped(scores).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(group_scores), 0.0)
            # DeepSeek-V2 as transformers implements it: no renormalisation of the top-k.
            weights, ids = scores.topk(m.num_experts_per_tok, dim=-1, sorted=False)
        return weights * m.routed_scaling_factor, ids

    def _grouped(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.view(scores.shape[0], self.moe.n_group, -1)  # [T, G, E/G]

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """Mask [T, E] of experts in each token's top `topk_group` groups."""
        m = self.moe
        top = group_scores.topk(m.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top, True)
        return keep.unsqueeze(-1).expand(-1, -1, m.n_routed_experts // m.n_group).flatten(1)


class MoE(nn.Module):
    """Under tensor parallelism every rank holds a slice of every expert (`moe` is the rank's
    config): the router is replicated, the experts' partial sums are added over the ranks
    once, after the shared experts."""

    def __init__(self, config: ModelConfig, moe: MoEConfig, comm: TPComm) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.comm = comm
        self.gate = MoEGate(hidden, moe)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, moe.moe_intermediate_size, reduce=False)
            for _ in range(moe.n_routed_experts)
        )
        self.shared_experts = (
            GatedMLP(
                hidden,
                moe.moe_intermediate_size * moe.n_shared_experts,
                config.mlp_bias,
                reduce=False,
            )
            if moe.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, k]
        out = torch.zeros_like(x)
        for expert_id in ids.unique().tolist():
            token_idx, slot = torch.where(ids == expert_id)
            y = self.experts[expert_id](x[token_idx]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.comm.all_reduce(out)


class DeepseekLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, comm: TPComm
    ) -> None:
        super().__init__()
        assert config.mla is not None
        self.self_attn = MLAAttention(config, config.mla, rotary, comm)
        moe = config.moe
        if moe is not None and layer_idx >= moe.first_k_dense_replace:
            self.mlp: nn.Module = MoE(config, moe, comm)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, comm)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, rope, kv_cache, meta, backend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, kv_cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekForCausalLM(CausalLM):
    stacked_rules = {
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }
    tp_rules = (
        ShardRule(".q_proj.", 0),
        ShardRule(".q_b_proj.", 0),
        ShardRule(".kv_b_proj.", 0),
        *ROW_PARALLEL_RULES,
        *MLP_RULES,
        *VOCAB_RULES,
    )

    def __init__(self, config: ModelConfig, comm: TPComm = SINGLE) -> None:
        assert config.mla is not None
        rotary = RotaryEmbedding(config.rope, config.mla.qk_rope_head_dim, config.max_position)
        local = local_config(config, comm.size)
        layers = [DeepseekLayer(local, i, rotary, comm) for i in range(config.num_layers)]
        super().__init__(config, layers, rotary, comm)

    def shard_sizes(self) -> dict[str, list[int] | int]:
        return {".gate_up_proj.": 2}  # dense, shared and routed MLPs: gate | up, equal halves

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        super().load_weights(_split_fused_experts(weights))

    def after_load(self) -> None:
        super().after_load()
        for layer in self.model.layers:
            layer.self_attn.absorb()


def _split_fused_experts(weights):
    """Accept transformers' fused expert tensors (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]) as well as the per-expert layout DeepSeek publishes."""
    for name, tensor in weights:
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2, dim=0)
                yield f"{prefix}{e}.gate_proj.weight", gate
                yield f"{prefix}{e}.up_proj.weight", up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e, w in enumerate(tensor):
                yield f"{prefix}{e}.down_proj.weight", w
        else:
            yield name, tensor
