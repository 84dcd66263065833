"""Random-weight Hugging Face checkpoints for the oracle tests, built with transformers."""

from __future__ import annotations

from pathlib import Path

import torch

INIT_RANGE = 0.2  # large enough that greedy outputs vary from token to token

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=1024,
    initializer_range=INIT_RANGE,
    bos_token_id=1,
    eos_token_id=2,
)


def _configs():
    import transformers as tf

    mla = dict(
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        num_key_value_heads=4,
    )
    return {
        "llama": lambda: tf.LlamaConfig(num_key_value_heads=2, **COMMON),
        "llama3-rope": lambda: tf.LlamaConfig(
            num_key_value_heads=1,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
            **COMMON,
        ),
        "qwen2": lambda: tf.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **COMMON),
        "mistral": lambda: tf.MistralConfig(num_key_value_heads=2, sliding_window=512, **COMMON),
        "deepseek_v2": lambda: tf.DeepseekV2Config(
            q_lora_rank=None,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            **mla,
            **COMMON,
        ),
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            q_lora_rank=48,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            **mla,
            **COMMON,
        ),
    }


KINDS = ("llama", "llama3-rope", "qwen2", "mistral", "deepseek_v2", "deepseek_v3")


def make_checkpoint(kind: str, directory: Path, seed: int = 0):
    """Save a random model of `kind` to `directory`; return the transformers model (fp32)."""
    import transformers as tf

    config = _configs()[kind]()
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind == "deepseek_v3":
        # a non-zero correction bias, so that the routing test covers it
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0, 0.1)
    model.eval()
    model.save_pretrained(directory)
    return model
