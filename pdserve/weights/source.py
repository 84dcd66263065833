"""Resolve a `model` argument to its config, weights and tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.config import ModelConfig
from pdserve.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch only where weights are made: a router resolves a model without it
    import torch

Weights = Iterator[tuple[str, "torch.Tensor"]]


@dataclass(frozen=True)
class ModelSource:
    name: str
    config: ModelConfig
    weights: Callable[..., Weights]  # called once, after the model is built (weights_on)
    tokenizer: Tokenizer | None
    # Hugging Face `model_type` for the transformers oracle and baseline, when there is one.
    hf_model_type: str | None = None
    # `weights(device)` makes them on that device (seeded random models: 8e9 normal samples
    # take tens of seconds on a host's cores and milliseconds on a GPU)
    draws_on_device: bool = False

    def weights_on(self, device: torch.device) -> Weights:
        """The weights for a model built on `device`: made there by a source that draws them
        (random models: the same seed gives the same weights on the same kind of device),
        read as the checkpoint has them otherwise."""
        return self.weights(device) if self.draws_on_device else self.weights()


RANDOM_PREFIX = "random:"  # random:CONFIG.json: that architecture, seeded random weights


def resolve(model: str) -> ModelSource:
    from pdserve.weights import presets

    if not isinstance(model, str) or not model:
        raise ValueError(f"model: expected a preset name or a path, got {model!r}")
    if model in presets.PRESETS:
        return presets.load_preset(model)
    if model.startswith(RANDOM_PREFIX):
        return presets.random_model(model[len(RANDOM_PREFIX) :])
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
        f"nor a .gguf file, nor random:CONFIG.json"
    )


def model_config(model: str) -> ModelConfig:
    """Only the architecture of `model`: a preset, a checkpoint directory (its config.json;
    weights need not be there), a config.json file, or a .gguf file. What the simulator and
    the planner need: no weights are read."""
    from pdserve.weights import presets
    from pdserve.weights.hf_config import model_config_from_hf

    if isinstance(model, str) and model in presets.TINY_CONFIGS:
        return presets.TINY_CONFIGS[model]
    if isinstance(model, str) and model.startswith(RANDOM_PREFIX):
        model = model[len(RANDOM_PREFIX) :]  # the architecture of random:CONFIG.json
    path = Path(model).expanduser() if isinstance(model, str) and model else None
    if path is not None and (path.is_dir() or path.suffix == ".json"):
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"model: {str(file)!r} does not exist")
        import json

        try:
            cfg = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"model: {str(file)!r} is not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"model: {str(file)!r} is not a JSON object")
        return model_config_from_hf(cfg)
    return resolve(model).config
