"""A decoder layer's small element-wise steps on CPU with the C kernels of
csrc/decode_ops_cpu.c: RMSNorm, SwiGLU's silu-and-multiply, rotary embedding, and greedy
sampling's argmax over the logits (torch's took 1.26 ms for 32 rows of SmolLM2's 49,152, one
thread, ~2% of a batch-32 step; this one 8 lanes a row, rows over the threads). At a decode
step's few rows each torch op costs mostly its dispatch, and these take five to ten each
(SmolLM2 at batch 8: RMSNorm 2.5 ms, RoPE 1.3 ms of a 40 ms step; docs/benchmarks.md).

fp32 CPU tensors with unit stride along the last axis; `available()` says whether this
machine can build the kernels, and callers keep the torch path for everything else. Each
function returns None for inputs it does not take, so that a caller can fall back in one
line.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from kernels.cpu_native import NativeUnavailable, load

_i64, _p, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float

_SIGNATURES = (
    ("rms_norm_f32", (_p, _i64, _p, _f32, _p, _i64, _i64, _i64, _int)),
    ("silu_and_mul_f32", (_p, _i64, _p, _i64, _i64, _i64, _int)),
    ("rope_f32", (_p, _i64, _i64, _p, _p, _i64, _p, _i64, _i64, _i64, _int, _int)),
    ("argmax_rows_f32", (_p, _i64, _i64, _i64, _p, _int)),
)


@cache
def _kernels() -> tuple | None:
    """(rms_norm, silu_and_mul, rope, argmax_rows) from the library, typed; None where it
    cannot be built. Looked up once: these run a few hundred times a decode step."""
    try:
        lib = load("decode_ops_cpu")
    except NativeUnavailable:
        return None
    fns = []
    for name, args in _SIGNATURES:
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = list(args)
        fns.append(fn)
    return tuple(fns)


def available() -> bool:
    """Whether the kernels build and load on this machine (built once, then cached)."""
    return _kernels() is not None


def _fits(*tensors: torch.Tensor) -> bool:
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors
    )


def _check(rc: int, what: str) -> None:
    if rc:
        raise ValueError(f"{what}: the kernel refused its arguments")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2, -1) + eps) for x [rows, dim]; None if not taken."""
    if x.dim() != 2 or x.numel() == 0 or weight.shape != x.shape[1:] or not _fits(x, weight):
        return None
    if not weight.is_contiguous() or (fns := _kernels()) is None:
        return None
    rows, dim = x.shape
    out = x.new_empty(rows, dim)
    rc = fns[0](
        x.data_ptr(), x.stride(0), weight.data_ptr(), eps, out.data_ptr(), dim, rows, dim,
        torch.get_num_threads(),
    )  # fmt: skip
    _check(rc, "rms_norm_f32")
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[:, :n]) * x[:, n:] for x [rows, 2n]; None if not taken."""
    if x.dim() != 2 or x.numel() == 0 or x.shape[1] % 2 or not _fits(x):
        return None
    if (fns := _kernels()) is None:
        return None
    rows, n = x.shape[0], x.shape[1] // 2
    out = x.new_empty(rows, n)
    rc = fns[1](x.data_ptr(), x.stride(0), out.data_ptr(), n, rows, n, torch.get_num_threads())
    _check(rc, "silu_and_mul_f32")
    return out


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor | None:
    """x [T, H, D] rotated by cos, sin [T, 1, D/2] (or [T, D/2]) -> a new [T, H, D]: the two
    halves of each head (or its even and odd elements, written out evens first, then odds)
    as (x1 cos - x2 sin, x2 cos + x1 sin); None if not taken."""
    if x.dim() != 3 or x.numel() == 0 or x.shape[-1] % 2 or not _fits(x, cos, sin):
        return None
    if (fns := _kernels()) is None:
        return None
    tokens, heads, dim = x.shape
    cos2, sin2 = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    if cos2.shape != (tokens, dim // 2) or sin2.shape != cos2.shape:
        return None
    if cos2.stride() != sin2.stride() or cos2.stride(1) != 1:
        return None
    out = x.new_empty(tokens, heads, dim)
    rc = fns[2](
        x.data_ptr(), x.stride(0), x.stride(1), cos2.data_ptr(), sin2.data_ptr(),
        cos2.stride(0), out.data_ptr(), tokens, heads, dim, int(interleaved),
        torch.get_num_threads(),
    )  # fmt: skip
    _check(rc, "rope_f32")
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """The index of each row's largest value for logits [rows, vocab] (the first one; a
    row's first NaN if it has one), as torch.argmax(dim=-1): int64 [rows]; None if not
    taken."""
    if logits.dim() != 2 or logits.numel() == 0 or not _fits(logits):
        return None
    if (fns := _kernels()) is None:
        return None
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    rc = fns[3](
        logits.data_ptr(), logits.stride(0), rows, n, out.data_ptr(), torch.get_num_threads()
    )
    _check(rc, "argmax_rows_f32")
    return out
