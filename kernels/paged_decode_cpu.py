"""Paged GQA and MLA decode on CPU with the C kernel of csrc/paged_decode_cpu.c.

Same contract as the torch references in paged_gqa_decode.py / paged_mla_decode.py, but
each sequence's KV is read once, in place in its blocks, instead of gathered into a padded
copy and attended by SDPA (on 2 cores at batch 32 x 1,024 tokens that copy-and-attend took
~9 ms per layer for 50 MB of KV). fp32 only; `available()` says whether this machine can
build it, and callers keep the references for everything else.
"""

from __future__ import annotations

import ctypes

import torch

from kernels._paged import check_cache
from kernels.cpu_native import NativeUnavailable, load
from kernels.paged_mla_decode import mla_as_gqa

_i64, _f32p, _i32p = ctypes.c_int64, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int32)


def _library() -> ctypes.CDLL:
    lib = load("paged_decode_cpu")
    fn = lib.paged_gqa_decode_f32
    if fn.restype is not ctypes.c_int or fn.argtypes is None:
        fn.restype = ctypes.c_int
        fn.argtypes = [
            _f32p, _f32p, _i64, _i64, _i64, _f32p, _i64, _i64, _i64,
            _i32p, _i64, _i32p, _f32p, _i64, _i64, _i64, _i64, _i64, _i64,
            ctypes.c_float, ctypes.c_int,
        ]  # fmt: skip
    return lib


def available() -> bool:
    """Whether the kernel builds and loads on this machine (built once, then cached)."""
    try:
        _library()
    except NativeUnavailable:
        return False
    return True


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
    )


def _ptr(t: torch.Tensor, kind):
    return ctypes.cast(t.data_ptr(), kind)


def paged_gqa_decode_cpu(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D], unit stride along D
    v_cache: torch.Tensor,  # [N, bs, Hkv, Dv], unit stride along Dv
    block_tables: torch.Tensor,  # [B, >= blocks of the longest context]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    max_context: int | None = None,  # context_lens' largest, when the caller knows it
) -> torch.Tensor:  # [B, Hq, Dv]
    check_cache("k_cache", k_cache, 4)
    check_cache("v_cache", v_cache, 4)
    if not supports(q, k_cache, v_cache):
        raise ValueError("paged_gqa_decode_cpu takes fp32 CPU tensors with unit-stride rows")
    batch, q_heads, dim = q.shape
    _, block_size, kv_heads, kdim = k_cache.shape
    vdim = v_cache.shape[-1]
    if kdim != dim or q_heads % kv_heads or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            f"shapes do not match: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
            f"v_cache {tuple(v_cache.shape)}"
        )
    if context_lens.shape != (batch,) or block_tables.dim() != 2 or block_tables.shape[0] < batch:
        raise ValueError(
            f"{batch} queries need {batch} context lengths and block table rows: got "
            f"{tuple(context_lens.shape)} and {tuple(block_tables.shape)}"
        )
    lens = context_lens.to(torch.int32).contiguous()
    if batch and max_context is None:
        max_context = int(lens.max())  # a reduction and a host read: per layer, per step
    if batch and max_context > block_tables.shape[1] * block_size:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns; a context of "
            f"{max_context} tokens needs more"
        )
    table = block_tables.to(torch.int32)
    if table.stride(-1) != 1:
        table = table.contiguous()
    q = q.contiguous()
    out = q.new_empty(batch, q_heads, vdim)
    if batch == 0:
        return out
    ks, vs = k_cache.stride(), v_cache.stride()
    rc = _library().paged_gqa_decode_f32(
        _ptr(q, _f32p), _ptr(k_cache, _f32p), ks[0], ks[1], ks[2],
        _ptr(v_cache, _f32p), vs[0], vs[1], vs[2],
        _ptr(table, _i32p), table.stride(0), _ptr(lens, _i32p), _ptr(out, _f32p),
        batch, q_heads, kv_heads, dim, vdim, block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise MemoryError("paged_gqa_decode_cpu: no memory for its work buffers")
    return out


def paged_mla_decode_cpu(
    q_latent: torch.Tensor,  # [B, H, r]
    q_pe: torch.Tensor,  # [B, H, dr]
    latent_cache: torch.Tensor,  # [N, bs, r + dr]
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context: int | None = None,
) -> torch.Tensor:  # [B, H, r]
    """MLA in the absorbed form: the latent rows are one KV head shared by every query head
    (keys: whole rows, values: their first r columns, read in place)."""
    q, k_cache, v_cache = mla_as_gqa(q_latent, q_pe, latent_cache)
    return paged_gqa_decode_cpu(q, k_cache, v_cache, block_tables, context_lens, scale, max_context)
