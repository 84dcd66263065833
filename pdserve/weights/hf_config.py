"""Hugging Face config.json -> ModelConfig, for the architectures pdserve runs."""

from __future__ import annotations

from typing import Any

from pdserve.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig

LLAMA_TYPES = ("llama", "qwen2", "mistral")
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
SUPPORTED_TYPES = LLAMA_TYPES + DEEPSEEK_TYPES


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def rope_from_hf(cfg: dict[str, Any], interleaved: bool) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("llama3", "yarn"):
        original = params.get(
            "original_max_position_embeddings", cfg.get("max_position_embeddings")
        )
    else:
        original = params.get("original_max_position_embeddings")

    def get(key: str, default):
        value = params.get(key)
        return default if value is None else value

    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(get("factor", 1.0)),
        original_max_position=original,
        low_freq_factor=float(get("low_freq_factor", 1.0)),
        high_freq_factor=float(get("high_freq_factor", 4.0)),
        beta_fast=float(get("beta_fast", 32.0)),
        beta_slow=float(get("beta_slow", 1.0)),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(get("truncate", True)),
        interleaved=interleaved,
    )


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise ValueError(
            f"config.json model_type: {model_type!r} is not supported; "
            f"choose one of {', '.join(SUPPORTED_TYPES)}"
        )
    try:
        return _build(cfg, model_type)
    except KeyError as e:
        raise ValueError(f"config.json: missing field {e.args[0]!r}") from None


def _build(cfg: dict[str, Any], model_type: str) -> ModelConfig:
    num_heads = cfg["num_attention_heads"]
    max_position = cfg.get("max_position_embeddings", 2048)
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        # pdserve attends to the whole context; within one window that equals Mistral's
        # sliding-window attention, so the model's length is capped at the window.
        max_position = min(max_position, cfg["sliding_window"])
    common = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        max_position=max_position,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        mlp_bias=cfg.get("mlp_bias", False),
        hidden_act=cfg.get("hidden_act", "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
    )
    if model_type in LLAMA_TYPES:
        bias = cfg.get("attention_bias", False)
        return ModelConfig(
            architecture="llama",
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type == "qwen2" else bias,
            rope=rope_from_hf(cfg, interleaved=False),
            **common,
        )
    mla = MLAConfig(
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        q_lora_rank=cfg.get("q_lora_rank"),
    )
    moe = None
    if cfg.get("n_routed_experts"):
        v3 = model_type == "deepseek_v3"
        moe = MoEConfig(
            n_routed_experts=cfg["n_routed_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
            topk_method="noaux_tc" if v3 else (cfg.get("topk_method") or "greedy"),
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
            first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
        )
    # V2 rotates interleaved pairs (complex form); V3 does when rope_interleave (its default).
    interleaved = model_type == "deepseek_v2" or cfg.get("rope_interleave", True)
    return ModelConfig(
        architecture="deepseek",
        head_dim=mla.qk_head_dim,
        qkv_bias=cfg.get("attention_bias", False),
        o_bias=cfg.get("attention_bias", False),
        rope=rope_from_hf(cfg, interleaved=interleaved),
        mla=mla,
        moe=moe,
        **common,
    )
