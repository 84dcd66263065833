"""Model families, chosen by `ModelConfig.architecture`."""

from __future__ import annotations

import torch

from pdserve.config import ModelConfig
from pdserve.models.base import CausalLM
from pdserve.models.deepseek import DeepseekForCausalLM, MoEGate
from pdserve.models.llama import LlamaForCausalLM
from pdserve.parallel.comm import SINGLE, TPComm
from pdserve.registry import Registry

MODEL_CLASSES: Registry[type[CausalLM]] = Registry(
    "architecture", {"llama": LlamaForCausalLM, "deepseek": DeepseekForCausalLM}
)


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    weights=None,
    load: bool = True,
    comm: TPComm = SINGLE,
) -> CausalLM:
    """Instantiate the model on `device` in `dtype` and load `weights` (name, tensor) pairs.
    Parameters are made on the device itself: an 8B-parameter model is not first built (and
    initialised) in host memory. With a tensor-parallel `comm`, this rank's shard only: the
    checkpoint is read tensor by tensor and each is cut before it is kept."""
    with torch.device(device):
        model = MODEL_CLASSES[config.architecture](config, comm)
    if load:
        model.load_weights(weights)
    model.to(device=device, dtype=dtype)
    for module in model.modules():
        if isinstance(module, MoEGate):
            module.float()  # routers score in fp32 whatever the model dtype
    model.after_load()
    return model.eval().requires_grad_(False)
