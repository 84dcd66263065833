"""Resolve a `model` argument to its config, weights and tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.config import ModelConfig
from pdserve.tokenizer import Tokenizer

Weights = Iterator[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class ModelSource:
    name: str
    config: ModelConfig
    weights: Callable[[], Weights]  # called once, after the model is built
    tokenizer: Tokenizer | None
    # Hugging Face `model_type` for the transformers oracle and baseline, when there is one.
    hf_model_type: str | None = None


def resolve(model: str) -> ModelSource:
    from pdserve.weights import presets

    if not isinstance(model, str) or not model:
        raise ValueError(f"model: expected a preset name or a path, got {model!r}")
    if model in presets.PRESETS:
        return presets.load_preset(model)
    path = Path(model).expanduser()
    if path.is_dir():
        from pdserve.weights.hf_checkpoint import load_hf_checkpoint

        return load_hf_checkpoint(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model: GGUF file {str(path)!r} does not exist")
        from pdserve.weights.gguf_file import load_gguf

        return load_gguf(path)
    names = ", ".join(sorted(presets.PRESETS))
    raise ValueError(
        f"model: {model!r} is neither a preset ({names}), nor a checkpoint directory, "
        f"nor a .gguf file"
    )
