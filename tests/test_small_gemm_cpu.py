"""The few-row CPU product of kernels/small_gemm_cpu.py against float64 products: every
chunk of rows (its register tiles differ by row count), weight row counts off its task
blocks, reduction lengths off its vector width, strided rows, a bias; and the Linear that
sends a decode step's few rows to it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from kernels import small_gemm_cpu
from pdserve.models import layers

needs_kernel = pytest.mark.skipif(
    not small_gemm_cpu.available(), reason="the C small-GEMM kernel does not build here"
)


def reference(x, w, b=None):
    y = x.double() @ w.double().T
    return (y if b is None else y + b.double()).float()


@needs_kernel
@pytest.mark.parametrize("rows", [*range(1, 18), 24, 33])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 5), (40, 48), (77, 130), (129, 576)])
def test_matches_a_float64_product(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n * 10 + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    tol = {"rtol": 1e-5, "atol": 1e-5 * k**0.5}
    torch.testing.assert_close(small_gemm_cpu.small_gemm(x, w), reference(x, w), **tol)
    torch.testing.assert_close(small_gemm_cpu.small_gemm(x, w, b), reference(x, w, b), **tol)


@needs_kernel
def test_strided_rows_are_read_in_place():
    gen = torch.Generator().manual_seed(3)
    big_x = torch.randn(6, 100, generator=gen)
    big_w = torch.randn(90, 120, generator=gen)
    x = big_x[:, 10:74]  # row stride 100, 64 columns
    w = big_w[5:80, 20:84]  # row stride 120: a column slice, as a tensor-parallel shard is
    assert not x.is_contiguous() and not w.is_contiguous()
    torch.testing.assert_close(small_gemm_cpu.small_gemm(x, w), reference(x, w))


@needs_kernel
def test_rows_are_independent_of_their_neighbours():
    # a row's result does not depend on which chunk or tile it went through
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(13, 96, generator=gen)
    w = torch.randn(50, 96, generator=gen)
    whole = small_gemm_cpu.small_gemm(x, w)
    for i in range(13):
        torch.testing.assert_close(
            small_gemm_cpu.small_gemm(x[i : i + 1], w)[0], whole[i], rtol=1e-6, atol=1e-6
        )


@needs_kernel
def test_empty_inputs_and_bad_ones():
    assert small_gemm_cpu.small_gemm(torch.empty(0, 8), torch.randn(4, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="fp32 CPU"):
        small_gemm_cpu.small_gemm(torch.randn(2, 8).double(), torch.randn(4, 8).double())
    with pytest.raises(ValueError, match="fp32 CPU"):
        small_gemm_cpu.small_gemm(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="fp32 CPU"):
        small_gemm_cpu.small_gemm(torch.randn(8, 2).T, torch.randn(4, 8))  # column stride 2
    with pytest.raises(ValueError, match="a bias of the"):
        small_gemm_cpu.small_gemm(torch.randn(2, 8), torch.randn(4, 8), torch.randn(5))


@needs_kernel
def test_linear_sends_few_rows_to_the_kernel_and_more_to_torch(monkeypatch):
    calls = []  # the products the kernel made
    real = small_gemm_cpu.try_small_gemm

    def counted(*args):
        out = real(*args)
        if out is not None:
            calls.append(args)
        return out

    monkeypatch.setattr(small_gemm_cpu, "try_small_gemm", counted)
    # where the panel kernel is off (PDSERVE_CPU_GEMM=onednn, or it does not build)
    monkeypatch.setattr(layers.Linear, "cpu_gemm", "onednn")
    torch.manual_seed(0)
    layer = layers.Linear(64, 48, bias=True).requires_grad_(False)
    layer.pack_for_cpu()
    for rows in (1, layers.Linear.native_rows, layers.Linear.native_rows + 1, 70):
        x = torch.randn(rows, 64)
        calls.clear()
        torch.testing.assert_close(layer(x), reference(x, layer.weight, layer.bias))
        assert len(calls) == (rows <= layers.Linear.native_rows)
    calls.clear()
    layer(torch.randn(2, 3, 64))  # not 2-D: torch's path
    layer.double()(torch.randn(2, 64).double())  # not fp32: torch's path
    assert not calls


def test_the_row_count_comes_from_the_environment():
    code = "from pdserve.models import layers; print(layers.Linear.native_rows)"

    def rows(value: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PDSERVE_SMALL_GEMM_ROWS": value}
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )

    assert rows("0").stdout.strip() == "0"
    assert rows("4").stdout.strip() == "4"
    bad = rows("lots")
    assert bad.returncode != 0 and "PDSERVE_SMALL_GEMM_ROWS='lots'" in bad.stderr


_OTHER_TARGET = """
import ctypes
import torch
from kernels import decode_ops_cpu, small_gemm_cpu
from kernels.cpu_native import load
from pdserve.config import RopeConfig
from pdserve.models.rope import RotaryEmbedding
assert small_gemm_cpu.available() and decode_ops_cpu.available()
assert load("small_gemm_cpu").small_gemm_lanes() == 8  # the AVX2 build, not this CPU's
gen = torch.Generator().manual_seed(1)
for rows in (*range(1, 10), 16, 17):  # every tile height of the 8-lane build
    for n, k in ((7, 5), (77, 130), (129, 576)):
        x, w, b = (torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen),
                   torch.randn(n, generator=gen))
        want = (x.double() @ w.double().T + b.double()).float()
        torch.testing.assert_close(small_gemm_cpu.small_gemm(x, w, b), want,
                                   rtol=1e-5, atol=1e-5 * k**0.5)
x = torch.randn(6, 64, generator=gen)
w = torch.randn(64, generator=gen)
want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
torch.testing.assert_close(decode_ops_cpu.rms_norm(x, w, 1e-5), want)
g = torch.randn(6, 64, generator=gen)
want = torch.nn.functional.silu(g[:, :32]) * g[:, 32:]
torch.testing.assert_close(decode_ops_cpu.silu_and_mul(g), want)
cos, sin = RotaryEmbedding(RopeConfig(), 32, 64).lookup(torch.arange(6), torch.float32)
q = torch.randn(6, 3, 32, generator=gen)
x1, x2 = q[..., :16], q[..., 16:]
want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
torch.testing.assert_close(decode_ops_cpu.rope(q, cos, sin, False), want)
from kernels import paged_decode_cpu, paged_gqa_decode_ref
for hq, hkv, dim in ((9, 3, 64), (12, 2, 72), (8, 1, 128)):  # score passes of 2 heads x 4 keys
    kc, vc = torch.randn(2, 40, 16, hkv, dim, generator=gen)
    lens = torch.tensor([1, 7, 16, 45, 120], dtype=torch.int32)
    table = torch.randperm(40, generator=gen)[:40].view(5, 8).to(torch.int32)
    qd = torch.randn(5, hq, dim, generator=gen)
    torch.testing.assert_close(
        paged_decode_cpu.paged_gqa_decode_cpu(qd, kc, vc, table, lens, 0.1),
        paged_gqa_decode_ref(qd, kc, vc, table, lens, 0.1), rtol=2e-5, atol=2e-5)
from kernels import panel_gemm_cpu
assert panel_gemm_cpu.nr() == 16 and panel_gemm_cpu.mr() == 6  # the AVX2 build's sizes
for rows in (*range(1, 8), 13, 200):  # every tile height, and past a block of tiles
    for n, k in ((7, 5), (33, 130)):
        x, w, b = (torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen),
                   torch.randn(n, generator=gen))
        want = (x.double() @ w.double().T + b.double()).float()
        torch.testing.assert_close(
            panel_gemm_cpu.try_panel_gemm(x, panel_gemm_cpu.pack(w), n, b), want,
            rtol=1e-5, atol=1e-5 * k**0.5)
print("ok")
"""

# what `-march=haswell` may use; a CPU without all of it would die on the build's code
_HASWELL = {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@needs_kernel
@pytest.mark.skipif(
    platform.machine() != "x86_64" or not _cpu_flags() >= _HASWELL,
    reason="the other target named here is x86 with AVX2 (haswell)",
)
def test_the_avx2_build_is_right_too(tmp_path):
    # CI machines may all have AVX-512, where the kernels' AVX2 paths never build:
    # build it on purpose, in a cache of its own, and check it the same way
    env = {
        **os.environ,
        "PDSERVE_KERNEL_MARCH": "haswell",
        "PDSERVE_KERNEL_CACHE": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_TARGET], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", (
        done.returncode,
        done.stderr[-3000:],
    )
    builds = sorted(p.name for p in tmp_path.glob("*.so"))
    assert [b.split("-")[0] for b in builds] == [
        "decode_ops_cpu",
        "paged_decode_cpu",
        "panel_gemm_cpu",
        "small_gemm_cpu",
    ], builds
