"""Checks and choices shared by the Triton launchers."""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_launchable(*tensors: torch.Tensor) -> None:
    """Triton kernels need CUDA tensors, or the interpreter (TRITON_INTERPRET=1 set before
    triton is imported) for CPU tensors."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors are on different devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before importing "
            "triton, to run them on the CPU)"
        )


def check_dtype(name: str, tensor: torch.Tensor, dtypes=FLOAT_DTYPES) -> None:
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {tensor.dtype} not in {dtypes}")


def check_index(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected int32 or int64, got {tensor.dtype}")


def choose_num_splits(programs: int, max_blocks: int, device: torch.device) -> int:
    """Split long contexts until about two programs per SM are in flight (flash-decoding)."""
    if device.type != "cuda" or max_blocks <= 1:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= 2 * sms:
        return 1
    return max(1, min(-(-2 * sms // programs), max_blocks, 32))


def check_tile(tokens: int) -> int:
    """Tokens per loop step of a decode kernel: a power of two >= 16 (tl.dot's tiles)."""
    if tokens < 16 or tokens & (tokens - 1):
        raise ValueError(f"tokens_per_step {tokens}: must be a power of two >= 16")
    return tokens
