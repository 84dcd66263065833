"""The panel kernel (kernels/panel_gemm_cpu.py): y = x w^T (+ b) with w packed in K-major
panels, against a float64 product at every tile height and panel edge, and the Linear that
packs its weight for it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import panel_gemm_cpu, small_gemm_cpu
from kernels.cpu_native import NativeUnavailable
from pdserve.models import layers

needs_kernel = pytest.mark.skipif(
    not panel_gemm_cpu.available(), reason="the panel GEMM kernel does not build here"
)
# a Linear keeps a packed copy (now panels) only where torch has oneDNN, as before
needs_packing = pytest.mark.skipif(
    not (panel_gemm_cpu.available() and layers.ONEDNN_LINEAR),
    reason="Linears pack their weights only where the kernel builds and torch has oneDNN",
)


def reference(x, w, b=None):
    out = x.double() @ w.double().T
    return (out if b is None else out + b.double()).float()


def close(got, want, k):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k**0.5)


@needs_kernel
def test_every_tile_height_and_panel_edge():
    gen = torch.Generator().manual_seed(0)
    nr, mr = panel_gemm_cpu.nr(), panel_gemm_cpu.mr()
    assert nr in (16, 32) and mr in (6, 14)
    # rows: every tile height, several tiles, past a block of them; columns: one panel
    # less one, exactly, one more, a partial last panel; K: 1 and not a multiple of anything
    for m in (*range(1, mr + 2), 2 * mr + 3, 16 * mr + 5):
        for n in (1, nr - 1, nr, nr + 1, 77):
            for k in (1, 13, 130):
                x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
                b = torch.randn(n, generator=gen) if (m + n) % 2 else None
                got = panel_gemm_cpu.try_panel_gemm(x, panel_gemm_cpu.pack(w), n, b)
                close(got, reference(x, w, b), k)


@needs_kernel
def test_strided_and_batched_inputs():
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    panels = panel_gemm_cpu.pack(w)
    wide = torch.randn(9, 30, generator=gen)
    x = wide[:, 3:27]  # rows 30 apart
    close(panel_gemm_cpu.try_panel_gemm(x, panels, 40, b), reference(x, w, b), 24)
    x3 = torch.randn(2, 5, 24, generator=gen)  # [..., K]
    got = panel_gemm_cpu.try_panel_gemm(x3, panels, 40, b)
    assert got.shape == (2, 5, 40)
    close(got.reshape(10, 40), reference(x3.reshape(10, 24), w, b), 24)
    xt = torch.randn(24, 6, generator=gen).T  # column stride 6: copied first
    close(panel_gemm_cpu.try_panel_gemm(xt, panels, 40, None), reference(xt, w), 24)
    assert panel_gemm_cpu.try_panel_gemm(torch.empty(0, 24), panels, 40, b).shape == (0, 40)
    # a weight packed from a strided view (rows 33 apart)
    tall = torch.randn(40, 33, generator=gen)
    x = torch.randn(4, 24, generator=gen)
    got = panel_gemm_cpu.try_panel_gemm(x, panel_gemm_cpu.pack(tall[:, :24]), 40, None)
    close(got, reference(x, tall[:, :24]), 24)


@needs_kernel
def test_inputs_it_does_not_take():
    w = torch.randn(40, 24)
    panels = panel_gemm_cpu.pack(w)
    x = torch.randn(3, 24)
    assert panel_gemm_cpu.try_panel_gemm(x.double(), panels, 40, None) is None
    assert panel_gemm_cpu.try_panel_gemm(torch.randn(3, 25), panels, 40, None) is None  # K
    assert panel_gemm_cpu.try_panel_gemm(x, panels, 70, None) is None  # not this weight's rows
    assert panel_gemm_cpu.try_panel_gemm(x, panels, 40, torch.randn(39)) is None
    with pytest.raises(ValueError, match="fp32 CPU weight"):
        panel_gemm_cpu.pack(w.double())
    with pytest.raises(ValueError, match="fp32 CPU weight"):
        panel_gemm_cpu.pack(torch.randn(24, 40).T)  # column stride 40


@needs_packing
def test_linear_multiplies_by_its_panels_and_follows_weight_changes(monkeypatch):
    calls = []
    real = panel_gemm_cpu.try_panel_gemm

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    few = []  # the rows the few-row kernel multiplied
    real_few = small_gemm_cpu.try_small_gemm

    def counted_few(*args):
        out = real_few(*args)
        if out is not None:
            few.append(args[0].shape[0])
        return out

    monkeypatch.setattr(panel_gemm_cpu, "try_panel_gemm", counted)
    monkeypatch.setattr(small_gemm_cpu, "try_small_gemm", counted_few)
    monkeypatch.setattr(layers.Linear, "cpu_gemm", "panel")
    torch.manual_seed(0)
    layer = layers.Linear(48, 40, bias=True).requires_grad_(False)
    assert layer.pack_for_cpu() and layer.panels is not None and layer.packed is None
    below = layers.PANEL_FROM_ROWS - 1  # fewer rows: the few-row kernel, where it builds
    for rows in (1, below, layers.PANEL_FROM_ROWS, 16, 17, 70):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    by_few = [1, below] if small_gemm_cpu.available() else []
    assert few == by_few and calls == [True] * (6 - len(by_few))
    n = len(calls)
    monkeypatch.setattr(layers.Linear, "panel_products", False)  # an A/B run's switch
    x = torch.randn(5, 48)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert len(calls) == n
    monkeypatch.setattr(layers.Linear, "panel_products", True)
    with torch.no_grad():
        layer.weight.mul_(2)  # changed in place after packing: the copy is dropped
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer.panels is None and len(calls) == n
    assert not layers.Linear(8, 8).to(torch.bfloat16).pack_for_cpu()  # fp32 only
    # where gradients are wanted, torch's product (the kernel's output has no backward)
    layer.pack_for_cpu()
    x = torch.randn(3, 48, requires_grad=True)
    y = layer(x)
    assert y.grad_fn is not None and len(calls) == n
    y.sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(3, 48))


@needs_packing
def test_a_weight_read_but_never_multiplied_keeps_no_copy():
    from pdserve.engine.args import EngineArgs
    from pdserve.engine.build import build_engine

    core, _ = build_engine("tiny-deepseek", EngineArgs(num_kv_blocks=8))
    try:
        attn = [m for m in core.runner.model.modules() if hasattr(m, "kv_b_proj")]
        assert attn and all(m.kv_b_proj.panels is None for m in attn)
        assert all(m.kv_b_proj.packed is None for m in attn)
        assert all(m.o_proj.panels is not None for m in attn)  # the others keep theirs
    finally:
        core.close()


def test_the_product_comes_from_the_environment():
    code = (
        "import torch\nfrom pdserve.models import layers\nl = layers.Linear(8, 8)\n"
        "l.pack_for_cpu()\nprint(layers.Linear.cpu_gemm, l.panels is not None)"
    )

    def run(value: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PDSERVE_CPU_GEMM": value}
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )

    assert run("onednn").stdout.split() == ["onednn", "False"]
    packs = panel_gemm_cpu.available() and layers.ONEDNN_LINEAR
    assert run("panel").stdout.split() == ["panel", str(packs)]
    bad = run("blas")
    assert bad.returncode != 0 and "PDSERVE_CPU_GEMM='blas'" in bad.stderr


def test_without_the_kernel_pack_says_so(monkeypatch):
    monkeypatch.setattr(panel_gemm_cpu, "_library", lambda: None)
    with pytest.raises(NativeUnavailable):
        panel_gemm_cpu.pack(torch.randn(4, 4))
