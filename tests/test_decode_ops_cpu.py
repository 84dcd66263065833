"""The C element-wise steps of kernels/decode_ops_cpu.py against the torch code they stand
in for (RMSNorm, SwiGLU's activation, RoPE in both layouts, greedy sampling's argmax): a
decode step's few rows and a
prefill chunk's many (its rows go to threads), strided views as the layers pass them, and
the inputs they decline."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import decode_ops_cpu
from pdserve.config import RopeConfig
from pdserve.models.layers import GatedMLP, RMSNorm
from pdserve.models.rope import RotaryEmbedding

needs_kernel = pytest.mark.skipif(
    not decode_ops_cpu.available(), reason="the C decode ops do not build here"
)
TOL = {"rtol": 1e-5, "atol": 1e-5}
ROWS = (1, 3, 16, 300)  # 300 x 576 and more: past the one-thread bound


def torch_rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [1, 7, 576])
def test_rms_norm_matches_torch(rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    wide = torch.randn(rows, dim + 5, generator=gen) * 3
    x = wide[:, 2 : 2 + dim]  # a column slice: row stride dim + 5
    w = torch.randn(dim, generator=gen)
    out = decode_ops_cpu.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, torch_rms_norm(x, w, 1e-5), **TOL)


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", [1, 5, 13, 1536])
def test_silu_and_mul_matches_torch(rows, n):
    gen = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, 2 * n, generator=gen) * 4  # large |x|: both tails of the sigmoid
    x[0, 0], x[-1, n - 1] = -100.0, 100.0
    out = decode_ops_cpu.silu_and_mul(x)
    torch.testing.assert_close(out, F.silu(x[:, :n]) * x[:, n:], **TOL)


@needs_kernel
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 9, 64), (5, 3, 2), (200, 9, 64)])
def test_rope_matches_the_torch_rotation(interleaved, tokens, heads, dim):
    gen = torch.Generator().manual_seed(tokens * heads + dim)
    rotary = RotaryEmbedding(RopeConfig(interleaved=interleaved), dim, 4096)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = rotary.lookup(positions, torch.float32)
    # q as the attention passes it: a view of the fused q/k/v projection's output
    qkv = torch.randn(tokens, heads * dim + 2 * dim, generator=gen)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    assert tokens == 1 or not q.is_contiguous()
    out = decode_ops_cpu.rope(q, cos, sin, interleaved)
    if interleaved:
        x1, x2 = q[..., 0::2], q[..., 1::2]
    else:
        x1, x2 = q[..., : dim // 2], q[..., dim // 2 :]
    expected = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    torch.testing.assert_close(out, expected, **TOL)


@needs_kernel
def test_what_the_kernels_decline_is_none():
    x = torch.randn(4, 8)
    assert decode_ops_cpu.rms_norm(x.double(), torch.ones(8).double(), 1e-5) is None
    assert decode_ops_cpu.rms_norm(x, torch.ones(7), 1e-5) is None
    assert decode_ops_cpu.rms_norm(x.view(2, 2, 8), torch.ones(8), 1e-5) is None
    assert decode_ops_cpu.rms_norm(torch.randn(8, 4).T, torch.ones(8), 1e-5) is None
    assert decode_ops_cpu.silu_and_mul(torch.randn(4, 7)) is None
    assert decode_ops_cpu.silu_and_mul(torch.randn(4, 8).half()) is None
    cos = sin = torch.randn(4, 1, 4)
    assert decode_ops_cpu.rope(torch.randn(4, 2, 6), cos, sin, False) is None  # D/2 != 4
    assert decode_ops_cpu.rope(torch.randn(4, 2, 8).double(), cos, sin, False) is None


@needs_kernel
def test_the_layers_give_the_same_results_with_or_without_the_kernels(monkeypatch):
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    mlp = GatedMLP(64, 96).requires_grad_(False)
    interleaved = RotaryEmbedding(RopeConfig(interleaved=True), 32, 256)
    halves = RotaryEmbedding(RopeConfig(), 32, 256)
    x = torch.randn(6, 64)
    rope = halves.lookup(torch.tensor([0, 5, 9, 100, 200, 255]), torch.float32)
    # as MLA passes them: q_pe a slice of wider heads, k_pe one head [T, 1, dr]
    q_pe = torch.randn(6, 4, 48)[..., 16:]
    k_pe = torch.randn(6, 40)[:, 8:].unsqueeze(1)

    def layers_out():
        return [norm(x), mlp(x), *halves(rope, q_pe, k_pe), *interleaved(rope, q_pe, k_pe)]

    fast = layers_out()
    for name in ("rms_norm", "silu_and_mul", "rope"):  # every kernel declines: torch's path
        monkeypatch.setattr(decode_ops_cpu, name, lambda *a: None)
    for got, want in zip(fast, layers_out(), strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_empty_inputs_are_declined():
    assert decode_ops_cpu.rms_norm(torch.empty(0, 8), torch.ones(8), 1e-5) is None
    assert decode_ops_cpu.silu_and_mul(torch.empty(0, 8)) is None
    assert (
        decode_ops_cpu.rope(torch.empty(0, 2, 8), torch.empty(0, 1, 4), torch.empty(0, 1, 4), False)
        is None
    )


@needs_kernel
@pytest.mark.parametrize("n", [1, 5, 8, 13, 16, 21, 49152])
def test_argmax_is_torchs_on_ties_infinities_and_nans(n):
    """The first index of the largest value per row, as torch.argmax: random rows, a tie
    (the earlier index wins, within a lane of the vector pass and across lanes), rows of
    -inf, a +inf, NaNs (the first NaN wins), rows a column slice apart; 64 rows of the
    vocabulary's width go to threads."""
    gen = torch.Generator().manual_seed(n)
    wide = torch.randn(64, n + 3, generator=gen)
    x = wide[:, 1 : 1 + n]  # row stride n + 3
    x[1] = float("-inf")
    x[2, -1] = float("inf")
    x[3, n // 2] = float("nan")
    x[3, -1] = float("nan")
    if n > 4:
        x[4, 1] = x[4, n - 2] = x[4].max() + 1  # tie: lanes 1 and (n - 2) % 8
        x[5, 0] = x[5, 8 % n] = x[5].max() + 1  # tie within lane 0 when n > 8
    x[6] = 0.0  # all equal
    x[7, 0] = float("nan")  # NaN first
    if n > 1:
        x[8] = 0.0
        x[8, 0], x[8, 1] = -0.0, 0.0  # -0.0 == 0.0: the first wins
        x[9, -1] = x[9].max() + 1  # the largest in the last element (the tail for n % 8)
    if n >= 16:
        x[10, 3] = x[10, 11] = x[10].max() + 1  # a tie in one lane of the vector pass
    got = decode_ops_cpu.argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist()


def test_argmax_declines_what_it_does_not_take():
    assert decode_ops_cpu.argmax(torch.empty(0, 8)) is None
    assert decode_ops_cpu.argmax(torch.randn(4, 8).double()) is None
    assert decode_ops_cpu.argmax(torch.randn(8)) is None
    assert decode_ops_cpu.argmax(torch.randn(8, 4).T) is None  # not unit stride
