"""The fp32 matrix product of a CPU model's Linears, with the C kernel of
csrc/panel_gemm_cpu.c: y = x w^T (+ b), w packed once into K-major panels.

`pack(weight)` lays a [N, K] weight out in panels of `nr()` rows (a copy the size of the
weight, kept beside it as oneDNN's packed copy was); `try_panel_gemm(x, panels, n, bias)`
multiplies any number of rows by it. On 2 vCPUs (AMD EPYC Zen 4), one decode step's worth of
SmolLM2-135M's projections and head: 1.07-1.44x faster than the few-row kernel at 4-16 rows
in the recorded run (at 1-2 rows the few-row kernel is the faster, and layers.Linear keeps
it there), 1.12x oneDNN's packed product at 32 rows and 1.04x at 64, and 0.95x at 2,048
(docs/benchmarks.md). `available()` says whether this
machine can build it; callers keep the other paths for everything else.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from kernels.cpu_native import NativeUnavailable, load

_i64, _p = ctypes.c_int64, ctypes.c_void_p


@cache
def _library() -> ctypes.CDLL | None:
    """The library with its functions typed, looked up once (its product runs ~120 times a
    decode step); None where it cannot be built."""
    try:
        lib = load("panel_gemm_cpu")
    except NativeUnavailable:
        return None
    lib.panel_gemm_nr.restype = ctypes.c_int
    lib.panel_gemm_mr.restype = ctypes.c_int
    lib.panel_gemm_pack.restype = None
    lib.panel_gemm_pack.argtypes = [_p, _i64, _i64, _i64, _p, ctypes.c_int]
    lib.panel_gemm_f32.restype = ctypes.c_int
    lib.panel_gemm_f32.argtypes = [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, ctypes.c_int]
    return lib


@cache
def _rows_per_panel() -> int:
    """nr(), looked up once (0 where the kernel does not build)."""
    lib = _library()
    return 0 if lib is None else lib.panel_gemm_nr()


def available() -> bool:
    """Whether the kernel builds and loads on this machine (built once, then cached)."""
    return _library() is not None


def nr() -> int:
    """Weight rows per panel in this machine's build (32 with AVX-512, 16 otherwise)."""
    if (lib := _library()) is None:
        raise NativeUnavailable("the panel GEMM kernel does not build here")
    return lib.panel_gemm_nr()


def mr() -> int:
    """Rows of x per tile in this machine's build (14 with AVX-512, 6 otherwise)."""
    if (lib := _library()) is None:
        raise NativeUnavailable("the panel GEMM kernel does not build here")
    return lib.panel_gemm_mr()


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """fp32 CPU tensors, a 2-D weight with unit-stride rows."""
    return (
        x.device.type == weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.stride(1) == 1
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (fp32, CPU, unit-stride rows) in panels: a flat tensor of
    ceil(N / nr()) * nr() * K floats. NativeUnavailable where the kernel does not build."""
    if (lib := _library()) is None:
        raise NativeUnavailable("the panel GEMM kernel does not build here")
    if not supports(weight, weight) or weight.shape[1] < 1:
        raise ValueError(
            f"pack takes a 2-D fp32 CPU weight with unit-stride rows, got "
            f"{tuple(weight.shape)} {weight.dtype} on {weight.device}"
        )
    n, k = weight.shape
    rows = -(-n // _rows_per_panel()) * _rows_per_panel()
    panels = torch.empty(rows * k, dtype=torch.float32)
    lib.panel_gemm_pack(
        weight.data_ptr(), weight.stride(0), n, k, panels.data_ptr(), torch.get_num_threads()
    )
    return panels


def try_panel_gemm(
    x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """x [..., K] @ w.T (+ bias) with w packed by `pack` (n: its rows), or None where the
    kernel does not take these inputs (or does not build): the Linear's one check per call."""
    if (lib := _library()) is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    if bias is not None and (
        bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()
    ):
        return None
    k = x.shape[-1]
    nr_ = _rows_per_panel()
    if k < 1 or panels.numel() != -(-n // nr_) * nr_ * k:
        return None
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = x2.new_empty(rows, n)
    if rows and n:
        rc = lib.panel_gemm_f32(
            x2.data_ptr(), x2.stride(0), panels.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(), n, rows, n, k,
            torch.get_num_threads(),
        )  # fmt: skip
        if rc == 2:
            raise MemoryError("panel_gemm_f32: no memory for the packed copy of x")
        if rc:
            raise ValueError(f"panel_gemm_f32 refused its arguments ({rows}x{k} by {n}x{k})")
    return out.view(*x.shape[:-1], n)
