from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter, which must be chosen before
# triton is first imported (pdserve imports it through `kernels`).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # tests/hf_models.py


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """kind -> (checkpoint directory, transformers model), built once per session."""
    from hf_models import make_checkpoint

    cache: dict[str, tuple[Path, object]] = {}

    def get(kind: str):
        if kind not in cache:
            directory = tmp_path_factory.mktemp(kind)
            cache[kind] = (directory, make_checkpoint(kind, directory))
        return cache[kind]

    return get
