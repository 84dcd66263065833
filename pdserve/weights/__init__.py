"""Where a model comes from: a preset name, a Hugging Face checkpoint directory or a .gguf file.

`resolve(model)` returns a `ModelSource`: the normalised `ModelConfig`, a lazy iterator of
Hugging Face-named weight tensors, and a tokenizer when the source has one.
"""

from pdserve.weights.source import ModelSource, model_config, resolve

__all__ = ["ModelSource", "model_config", "resolve"]
