"""What a cost model needs of a model, from its ModelConfig alone: weights, KV bytes and
FLOPs per token, per GPU of a tensor-parallel group.

    shape = ModelShape.of(config, weight_dtype_bytes=2, kv_dtype_bytes=2, tp=8)
    shape.weight_bytes           # one GPU's shard of every weight
    shape.kv_bytes_per_token     # one token's KV, every layer, on one GPU
    shape.flops_per_token        # 2 x the weights a token passes through, on one GPU

Under tensor parallelism weights are split k ways (embeddings and the LM head too, as vLLM
shards them by vocabulary); GQA KV heads are split too, and replicated once k exceeds
them; MLA's latent is one head: every rank holds all of it (so MLA models gain no KV room
from TP, which is why they run attention data-parallel). MoE: all experts count as weight
bytes; a token passes through its top-k and the shared experts.

`dp_attention=True` (with tp=k): attention data-parallel inside the group, as MLA models are
served (SGLang's DP attention). Each rank holds the attention weights (and the input
embedding) whole and attends for its own requests only, with their whole KV (every head, or
the whole latent), so the group holds k times the requests a rank's pool fits; the MLP
(dense or MoE) stays split k ways and runs on every rank's tokens at once (gathered before
it, scattered after). The figures of such a shape are one rank's for a step of its own
`tokens`, with every rank of the group assumed to carry as many (a router balancing by room
keeps them near).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import ModelConfig


def _attention_params(c: ModelConfig) -> int:
    h = c.hidden_size
    if c.mla is None:
        q = c.num_heads * c.head_dim
        kv = c.num_kv_heads * c.head_dim
        return h * q + 2 * h * kv + q * h
    m = c.mla
    qk = c.num_heads * m.qk_head_dim
    q = h * qk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank * qk
    kv_down = h * (m.kv_lora_rank + m.qk_rope_head_dim)
    kv_up = m.kv_lora_rank * c.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv_down + kv_up + c.num_heads * m.v_head_dim * h


def _mlp_params(c: ModelConfig, layer: int) -> tuple[int, int]:
    """(weights of the layer's MLP, those one token passes through)."""
    h = c.hidden_size
    moe = c.moe
    if moe is None or layer < moe.first_k_dense_replace:
        dense = 3 * h * c.intermediate_size
        return dense, dense
    expert = 3 * h * moe.moe_intermediate_size
    router = h * moe.n_routed_experts
    total = moe.n_routed_experts * expert + moe.n_shared_experts * expert + router
    active = (moe.num_experts_per_tok + moe.n_shared_experts) * expert + router
    return total, active


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    params: int  # every weight of the model
    attention_params: int  # the attention layers' weights (whole on each rank: dp_attention)
    embedding_params: int  # the input embedding (whole on each rank under dp_attention too)
    active_params: int  # the weights one token passes through
    expert_params: int  # routed experts' weights (read only as far as tokens touch them)
    experts: int  # routed experts per MoE layer (0: dense)
    experts_per_token: int
    moe_layers: int
    tp: int
    weight_dtype_bytes: float  # 2 for bf16, 1 for FP8 weights
    kv_bytes_per_token: int  # one GPU of the TP group
    attn_flops_per_context_token: float  # one GPU: per new token per token of its context
    dp_attention: bool = False

    @staticmethod
    def of(
        config: ModelConfig,
        weight_dtype_bytes: float = 2,
        kv_dtype_bytes: int = 2,
        tp: int = 1,
        dp_attention: bool = False,
    ) -> ModelShape:
        if tp < 1:
            raise ValueError(f"tp: must be >= 1, got {tp}")
        c = config
        embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        attn = _attention_params(c)
        # a rank attends with every head for its own requests (dp_attention), or with its
        # 1/tp of them for every request of the group
        split = 1 if dp_attention else tp
        total = active = embed + c.num_layers * attn
        expert_params, moe_layers = 0, 0
        for layer in range(c.num_layers):
            layer_total, layer_active = _mlp_params(c, layer)
            total += layer_total
            active += layer_active
            if c.moe is not None and layer >= c.moe.first_k_dense_replace:
                moe_layers += 1
                expert_params += (
                    c.moe.n_routed_experts * 3 * c.hidden_size * (c.moe.moe_intermediate_size)
                )
        if c.mla is None:
            kv_heads = max(1, c.num_kv_heads // split) if split <= c.num_kv_heads else 1
            per_layer = 2 * kv_heads * c.head_dim
            heads = c.num_heads / split
            # QK^T and PV: 2 x 2 x head_dim FLOPs per head per context token
            attn_flops = 4 * c.head_dim * heads * c.num_layers
        else:
            m = c.mla
            per_layer = m.kv_lora_rank + m.qk_rope_head_dim  # the latent: replicated
            heads = c.num_heads / split
            # absorbed MLA: scores over [c_kv | k_pe], then the latent-weighted sum
            attn_flops = 2 * heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * c.num_layers
        return ModelShape(
            num_layers=c.num_layers,
            hidden_size=c.hidden_size,
            params=total,
            attention_params=c.num_layers * attn,
            embedding_params=c.vocab_size * c.hidden_size,
            active_params=active,
            expert_params=expert_params,
            experts=c.moe.n_routed_experts if c.moe is not None else 0,
            experts_per_token=c.moe.num_experts_per_tok if c.moe is not None else 0,
            moe_layers=moe_layers,
            tp=tp,
            weight_dtype_bytes=weight_dtype_bytes,
            kv_bytes_per_token=per_layer * c.num_layers * kv_dtype_bytes,
            attn_flops_per_context_token=attn_flops,
            dp_attention=dp_attention and tp > 1,
        )

    @property
    def _whole(self) -> int:
        """The weights every rank holds whole (dp_attention: the attention layers, and the
        input embedding, which SGLang does not split under DP attention; the LM head stays
        split by vocabulary)."""
        return self.attention_params + self.embedding_params if self.dp_attention else 0

    @property
    def weight_bytes(self) -> int:
        """One GPU's shard of every weight (dp_attention: the attention layers whole)."""
        return int((self._whole + (self.params - self._whole) / self.tp) * self.weight_dtype_bytes)

    @property
    def group_factor(self) -> int:
        """The group's tokens in a step over one rank's (dp_attention: every rank's own
        tokens meet in the MLP; otherwise every rank computes the same tokens)."""
        return self.tp if self.dp_attention else 1

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes one step of `tokens` tokens reads on one GPU: everything but the
        routed experts, plus the experts some token of the step chose (a token picks its
        top-k of E; the expected share of experts touched is 1 - (1 - k/E)^tokens, over the
        group's tokens under dp_attention)."""
        b = self.weight_dtype_bytes
        dense = (self._whole + (self.params - self._whole - self.expert_params) / self.tp) * b
        if not self.experts:
            return dense
        group = max(tokens, 1) * self.group_factor
        touched = 1 - (1 - self.experts_per_token / self.experts) ** group
        return dense + touched * self.expert_params * b / self.tp

    @property
    def flops_per_token(self) -> float:
        """Matrix FLOPs of one token through the weights, on one GPU (dp_attention: a
        rank's own token through the whole attention, and its 1/tp of the MLP for each of
        the group's tokens, tp of them per own token: the whole MLP's worth)."""
        if self.dp_attention:
            return 2 * self.active_params
        return 2 * self.active_params / self.tp
