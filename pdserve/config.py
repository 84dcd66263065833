"""Frozen, validated configuration: one dataclass per concern.

`ModelConfig` is the architecture as pdserve needs it (normalised from a Hugging Face
config.json or GGUF metadata by `pdserve.weights`), `CacheConfig` the paged KV pool and
`SchedulerConfig` the batching limits. Each is validated on construction and raises
`ValueError` naming the bad field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pdserve.registry import Registry

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# What a preempted request's KV becomes, by the spill tiers (in order) it may be parked in:
# none (dropped and computed again), host memory, or host -> CXL -> disk.
PREEMPTION: Registry[tuple[str, ...]] = Registry(
    "preemption", {"recompute": (), "swap": ("host",), "tiered": ("host", "cxl", "disk")}
)
# What a decode worker and the colocated LLM run given no flags (with DEFAULT_ADMISSION in
# pdserve/engine/admission.py; docs/capacity-trap.md). EngineArgs itself keeps recompute: a
# bare engine core (a prefill worker's, the simulator's) gets no spill tiers it did not ask for.
DEFAULT_PREEMPTION = "tiered"


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name}: {message}")


class KVLayout(Enum):
    """How one token's KV is stored in a layer's block pool."""

    GQA = "gqa"  # per-head K and V: [2, num_kv_heads, head_dim]
    MLA = "mla"  # DeepSeek's compressed latent [c_kv | k_pe]: [kv_lora_rank + rope_dim]


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # Context length the model was pre-trained on (llama3 and yarn scaling).
    original_max_position: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn (DeepSeek also scales the softmax with it)
    attention_factor: float | None = None  # yarn; derived from mscale when None
    truncate: bool = True  # yarn
    # DeepSeek rotates adjacent pairs (x0, x1), (x2, x3)...; Llama rotates the two halves.
    interleaved: bool = False

    def __post_init__(self) -> None:
        _require(self.theta > 0, "rope_theta", f"must be > 0, got {self.theta}")
        _require(
            self.rope_type in ROPE_TYPES,
            "rope_scaling.rope_type",
            f"{self.rope_type!r} is not supported; choose one of {', '.join(ROPE_TYPES)}",
        )
        _require(self.factor > 0, "rope_scaling.factor", f"must be > 0, got {self.factor}")
        if self.rope_type in ("llama3", "yarn"):
            _require(
                self.original_max_position is not None and self.original_max_position > 0,
                "rope_scaling.original_max_position_embeddings",
                f"is required for rope_type {self.rope_type!r}",
            )
        if self.rope_type == "llama3":
            _require(
                self.high_freq_factor > self.low_freq_factor,
                "rope_scaling.high_freq_factor",
                "must be greater than low_freq_factor",
            )


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek multi-head latent attention dimensions."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _require(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even")
        if self.q_lora_rank is not None:
            _require(self.q_lora_rank > 0, "q_lora_rank", "must be > 0 or null")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


MOE_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-style mixture of experts with shared experts."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    # "greedy" / "group_limited_greedy": softmax scores (DeepSeek-V2);
    # "noaux_tc": sigmoid scores plus a correction bias, grouped (DeepSeek-V3).
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    first_k_dense_replace: int = 0

    def __post_init__(self) -> None:
        _require(
            self.topk_method in MOE_TOPK_METHODS,
            "topk_method",
            f"{self.topk_method!r} is not supported; choose one of {', '.join(MOE_TOPK_METHODS)}",
        )
        _require(self.n_routed_experts > 0, "n_routed_experts", "must be > 0")
        _require(
            0 < self.num_experts_per_tok <= self.n_routed_experts,
            "num_experts_per_tok",
            f"must be in 1..{self.n_routed_experts}, got {self.num_experts_per_tok}",
        )
        _require(
            self.n_routed_experts % self.n_group == 0,
            "n_group",
            f"must divide n_routed_experts={self.n_routed_experts}",
        )
        _require(0 < self.topk_group <= self.n_group, "topk_group", "must be in 1..n_group")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" (Llama/Qwen2/Mistral) or "deepseek" (V2/V3)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope: RopeConfig = field(default_factory=RopeConfig)
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _require(
            self.architecture in ("llama", "deepseek"),
            "architecture",
            f"{self.architecture!r} is not supported (llama, deepseek)",
        )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position",
        ):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "num_key_value_heads",
            f"{self.num_kv_heads} must divide num_attention_heads={self.num_heads}",
        )
        _require(self.hidden_act == "silu", "hidden_act", f"only silu, got {self.hidden_act!r}")
        _require(
            (self.architecture == "deepseek") == (self.mla is not None),
            "mla",
            "MLA dimensions are required for DeepSeek models and only for them",
        )

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout.MLA if self.mla is not None else KVLayout.GQA

    @property
    def kv_token_shape(self) -> tuple[int, ...]:
        """Shape of one token's KV entry in one layer."""
        if self.mla is not None:
            return (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim,)
        return (2, self.num_kv_heads, self.head_dim)

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of KV cache one token occupies across all layers."""
        n = 1
        for d in self.kv_token_shape:
            n *= d
        return n * self.num_layers


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size > 0, "block_size", f"must be > 0, got {self.block_size}")
        _require(self.num_blocks > 0, "num_kv_blocks", f"must be > 0, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    # Token budget of one engine step; longer prompts are prefilled in chunks of this size.
    max_num_batched_tokens: int = 2048
    # What a preempted request's KV becomes: "recompute" (dropped, computed again later),
    # "swap" or "tiered" (kept in spill tiers and reloaded; see pdserve/kv/spill.py)
    preemption: str = "recompute"

    def __post_init__(self) -> None:
        PREEMPTION.check(self.preemption)
        _require(self.max_model_len > 0, "max_model_len", f"must be > 0, got {self.max_model_len}")
        _require(self.max_num_seqs > 0, "max_num_seqs", f"must be > 0, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens > 0,
            "max_num_batched_tokens",
            f"must be > 0, got {self.max_num_batched_tokens}",
        )
