"""The few-row fp32 matrix product a CPU decode step runs, with the C kernel of
csrc/small_gemm_cpu.c: y = x w^T (+ b), x [M, K], w [N, K] as torch keeps a Linear's weight.

At a few rows a projection is a stream over its weight, and oneDNN's packed GEMM reads it
well below the machine's bandwidth (2 vCPUs, SmolLM2-135M's 121 projections and head per
step: 24-32 ms at 1-8 rows where the kernel takes 20-26 ms; docs/benchmarks.md). The kernel
reads the weight in place, so it needs no copy. `available()` says whether this machine can
build it; callers keep torch's path for everything else.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from kernels.cpu_native import NativeUnavailable, load

_i64, _p = ctypes.c_int64, ctypes.c_void_p


@cache
def _kernel():
    """The typed C function, looked up once (it runs ~120 times a decode step); None where
    the library cannot be built."""
    try:
        fn = load("small_gemm_cpu").small_gemm_f32
    except NativeUnavailable:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [_p, _i64, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, ctypes.c_int]
    return fn


def available() -> bool:
    """Whether the kernel builds and loads on this machine (built once, then cached)."""
    return _kernel() is not None


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """fp32 CPU tensors, x 2-D with unit stride along K, a weight with unit-stride rows."""
    return (
        x.device.type == weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and x.dim() == 2
        and weight.dim() == 2
        and x.shape[1] == weight.shape[1]
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    )


def small_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) for `supports()` inputs; any row count (past 8 rows each
    weight row is read again per 8, from the caches). NativeUnavailable where the kernel
    does not build, ValueError for inputs it does not take."""
    if not available():
        raise NativeUnavailable("the small-GEMM kernel does not build here")
    if (out := try_small_gemm(x, weight, bias)) is None:
        raise ValueError(
            f"small_gemm takes fp32 CPU tensors with unit-stride rows and a bias of the "
            f"weight's rows: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}, bias {None if bias is None else tuple(bias.shape)}"
        )
    return out


def try_small_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """small_gemm, or None for inputs it does not take (or where it does not build): the
    Linear's one check per call."""
    if not supports(x, weight, bias) or (bias is not None and bias.shape != weight.shape[:1]):
        return None
    if (fn := _kernel()) is None:
        return None
    rows, k = x.shape
    n = weight.shape[0]
    out = x.new_empty(rows, n)
    if rows == 0 or n == 0:
        return out
    rc = fn(
        x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
        None if bias is None else bias.data_ptr(), out.data_ptr(), n,
        rows, n, k, torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise ValueError(f"small_gemm_f32 refused its arguments ({rows}x{k} by {n}x{k})")
    return out
