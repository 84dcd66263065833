"""Load a GGUF file (llama / qwen2 architectures): metadata -> ModelConfig, tensors
dequantized -> Hugging Face names, and the tokenizer and chat template it carries."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.config import ModelConfig, RopeConfig
from pdserve.tokenizer import tokenizer_from_gguf_vocab
from pdserve.weights.source import ModelSource, Weights

if TYPE_CHECKING:
    import torch

_LAYER_NAMES = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)
_TOP_NAMES = MappingProxyType(
    {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)
SUPPORTED_ARCHS = ("llama", "qwen2")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not one pdserve knows")
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> rotated halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(reader: Any, arch: str) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    vocab = get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        architecture="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=n_heads,
        num_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=int(get("rope.dimension_count", hidden // n_heads)),
        max_position=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        qkv_bias=arch == "qwen2",
        rope=RopeConfig(theta=float(get("rope.freq_base", 10000.0))),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _weights(reader: Any, config: ModelConfig, permuted: bool) -> Weights:
    import gguf
    import torch  # here, not at import: a router resolves the model for its tokenizer

    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; dequantize returns them slowest-first (torch order).
        tensor = torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy
        name = hf_name(t.name)
        if permuted and name.endswith("q_proj.weight"):
            tensor = unpermute_rope(tensor, config.num_heads)
        elif permuted and name.endswith("k_proj.weight"):
            tensor = unpermute_rope(tensor, config.num_kv_heads)
        yield name, tensor


def load_gguf(path: Path) -> ModelSource:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as e:
        raise ValueError(f"model: {str(path)!r} is not a readable GGUF file ({e})") from None
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported ({SUPPORTED_ARCHS})")
    config = _config(reader, arch)
    tokenizer = None
    if _field(reader, "tokenizer.ggml.model") == "gpt2":
        tokenizer = tokenizer_from_gguf_vocab(
            tokens=list(_field(reader, "tokenizer.ggml.tokens")),
            token_types=list(_field(reader, "tokenizer.ggml.token_type")),
            merges=list(_field(reader, "tokenizer.ggml.merges")),
            pre=_field(reader, "tokenizer.ggml.pre"),
            bos_id=config.bos_token_id,
            eos_id=config.eos_token_ids[0] if config.eos_token_ids else None,
            add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
            chat_template=_field(reader, "tokenizer.chat_template"),
        )
    # llama.cpp permutes llama q/k rows for its interleaved RoPE; qwen2 uses the halves form.
    permuted = arch == "llama"
    return ModelSource(
        name=str(path),
        config=config,
        weights=lambda: _weights(reader, config, permuted),
        tokenizer=tokenizer,
        hf_model_type="llama" if arch == "llama" else "qwen2",
    )
