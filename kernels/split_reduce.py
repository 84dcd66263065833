"""Split-KV (flash-decoding) reduction: merge per-split partial attention outputs.

A decode kernel that splits each sequence's context into S ranges writes, per (sequence,
head, split), the split's softmax-normalised output and its log-sum-exp. This kernel merges
them exactly:

    out[b, h] = sum_s exp(lse[b, h, s] - L) * part[b, h, s] / sum_s exp(lse[b, h, s] - L)

with L = max_s lse[b, h, s]. Empty splits carry lse = -inf and weigh nothing.

Shapes:
    part:  [B, H, S, Dv] fp32
    lse:   [B, H, S]     fp32
    out:   [B, H, Dv]    any float dtype (written)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_reduce_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_DV)
    s_mask = offs_s < num_splits
    lse = tl.load(
        lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf")
    )
    top = tl.max(lse, axis=0)
    weight = tl.where(s_mask, tl.exp(lse - top), 0.0)  # [BLOCK_S]
    parts = tl.load(
        part_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM_V),
        other=0.0,
    )  # [BLOCK_S, BLOCK_DV]
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM_V,
    )


def split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial-result buffers for a decode kernel writing `out` [B, H, Dv] in `num_splits`
    splits: with one split the kernel writes `out` directly (no lse, no reduction)."""
    if num_splits == 1:
        return out.unsqueeze(2), out.new_empty(0, dtype=torch.float32)
    batch, heads, dv = out.shape
    part = out.new_empty(batch, heads, num_splits, dv, dtype=torch.float32)
    return part, out.new_empty(batch, heads, num_splits, dtype=torch.float32)


def split_reduce(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    batch, heads, splits, dv = part.shape
    if part.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError("part and lse must be fp32")
    if lse.shape != (batch, heads, splits) or out.shape != (batch, heads, dv):
        raise ValueError(f"shapes disagree: part {part.shape}, lse {lse.shape}, out {out.shape}")
    if part.stride(-1) != 1 or lse.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("part, lse and out must be contiguous in their last dimension")
    if batch == 0:
        return out
    _split_reduce_kernel[(batch, heads)](
        part,
        lse,
        out,
        splits,
        *part.stride()[:3],
        *lse.stride()[:2],
        *out.stride()[:2],
        HEAD_DIM_V=dv,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_DV=triton.next_power_of_2(dv),
    )
    return out


def split_reduce_ref(part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    weights = torch.softmax(lse, dim=-1)  # [B, H, S]
    return (part * weights[..., None]).sum(dim=2)
