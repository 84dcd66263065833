"""Rotary position embeddings: frequency schedules and their application.

Schedules (formulas as published): default RoPE (Su et al., 2021); `linear` position
interpolation (inverse frequencies divided by `factor`); `llama3` (Meta's wavelength-banded
scaling: long wavelengths divided by `factor`, short kept, a smooth ramp in between); `yarn`
(Peng et al., 2023: a per-dimension ramp between interpolation and extrapolation, and an
attention factor that scales cos/sin).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels import decode_ops_cpu
from pdserve.config import RopeConfig

RopeTable = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, dim // 2]


def inverse_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [dim // 2] fp32, attention factor applied to cos and sin)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    return _yarn(rope, dim)


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    assert rope.original_max_position is not None
    old_len = rope.original_max_position
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    assert rope.original_max_position is not None
    factor, base = rope.factor, rope.theta
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where the dimension extrapolates (high frequency)
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k with a cos/sin table precomputed up to `max_position`."""

    def __init__(self, rope: RopeConfig, dim: int, max_position: int) -> None:
        super().__init__()
        # the table is computed on the CPU, then moved where the model is built: on the meta
        # device (a random model's names and shapes) these ops would go through torch's
        # Python references, whose first use imports torch._dynamo (over a second per process)
        device = torch.empty(()).device  # the device context's (get_default_device: torch 2.8+)
        with torch.device("cpu"):
            inv_freq, attention_factor = inverse_frequencies(rope, dim)
            positions = torch.arange(max_position, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]  # [max_position, dim // 2]
            cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        self.interleaved = rope.interleaved
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTable:
        """cos and sin of a step's positions [T], looked up once and shared by all layers."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [T, 1, dim // 2]
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, sin

    def forward(
        self, table: RopeTable, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, dim], k: [T, Hk, dim]
        cos, sin = table
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # fp32 on CPU: one C call, not seven ops
        if (out := decode_ops_cpu.rope(x, cos, sin, self.interleaved)) is not None:
            return out
        if self.interleaved:
            # pairs (x0, x1), (x2, x3), ...; output de-interleaved (evens then odds). q and k
            # get the same permutation, so q.k is unchanged.
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
