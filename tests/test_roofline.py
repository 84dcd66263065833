"""bench roofline (pdserve/bench/roofline.py) on the tiny random checkpoint: the bytes a
decode step reads, and a small grid run for real."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.roofline import bench_roofline, format_table, weight_bytes_read
from pdserve.models.layers import ONEDNN_LINEAR, Linear


def test_a_tied_table_is_read_once_and_an_untied_input_table_not_at_all():
    class Tiny(torch.nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.model = torch.nn.Module()
            self.model.embed_tokens = torch.nn.Embedding(10, 4)  # 40 floats
            self.lm_head = torch.nn.Linear(4, 10, bias=False)  # 40 floats
            self.norm = torch.nn.LayerNorm(4)  # 8 floats
            if tied:
                self.lm_head.weight = self.model.embed_tokens.weight

    assert weight_bytes_read(Tiny(tied=True)) == (40 + 8) * 4
    assert weight_bytes_read(Tiny(tied=False)) == (40 + 8) * 4  # the LM head, not the input


@pytest.mark.parametrize("cpu_gemm", ["panel", "onednn"])
def test_a_small_grid_reports_every_point_against_the_bandwidth_it_measured(cpu_gemm, monkeypatch):
    monkeypatch.setattr(Linear, "cpu_gemm", cpu_gemm)
    report = bench_roofline(
        "tiny-llama", batches=(1, 4), contexts=(16, 64), steps=1, bandwidth_bytes=32 << 20
    )
    assert report["read_bandwidth_gb_s"] > 0
    # tiny-llama: 2 layers x K and V x 2 KV heads x 16 dims x 4 bytes (fp32)
    assert report["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    # its weights as a step reads them: per layer q, k, v, o, the gated MLP and two norms,
    # then the final norm and the untied LM head; never the input embedding table
    h, inter, q, kv = 64, 128, 4 * 16, 2 * 16
    layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    assert report["weight_bytes_read"] == (2 * layer + h + 384 * h) * 4
    points = {(r["batch"], r["context"]) for r in report["rows"]}
    assert points == {(1, 16), (4, 16), (1, 64), (4, 64)}
    for r in report["rows"]:
        kv = r["batch"] * r["context"] * report["kv_bytes_per_token"]
        assert r["bytes_read"] == report["weight_bytes_read"] + kv
        assert r["roofline_s"] == pytest.approx(
            r["bytes_read"] / 1e9 / report["read_bandwidth_gb_s"]
        )
        assert r["fraction_of_roofline"] == pytest.approx(r["roofline_s"] / r["step_s"])
        # FLOPs: 2 per Linear weight element (the same elements as above but the norms and
        # the embedding) per request, and per layer, query head and context token 2 x 16
        # dims for the scores and 2 x 16 for the values
        linear = 2 * (2 * (layer - 2 * h) + 384 * h)
        attention = 2 * 4 * r["context"] * 2 * 16 * 2
        assert r["flops"] == r["batch"] * (linear + attention)
        assert r["compute_s"] == pytest.approx(r["flops"] / 1e9 / report["matmul_gflop_s"])
        assert r["bound_s"] == max(r["roofline_s"], r["compute_s"])
        assert r["bound_by"] == ("memory" if r["roofline_s"] >= r["compute_s"] else "compute")
        assert r["fraction_of_bound"] == pytest.approx(r["bound_s"] / r["step_s"])
    assert report["matmul_gflop_s"] > 0
    assert "(0." in format_table(report) or "(1." in format_table(report)
    # the panel kernel's A/B: every point timed again on the products it replaced
    panels = Linear.uses_panels(torch.device("cpu"), torch.float32) and ONEDNN_LINEAR
    assert report["panel_gemm"] == panels
    for r in report["rows"]:
        assert (r["previous_linear_step_s"] is not None) == panels, r
    if panels:
        assert "the products the panel kernel replaced" in format_table(report)
    # without it, the few-row kernel's A/B: every point it ran at timed again on torch's path
    rows = report["small_gemm_rows"]
    assert rows == (0 if panels else Linear.kernel_rows(torch.device("cpu"), torch.float32))
    for r in report["rows"]:
        assert (r["torch_linear_step_s"] is not None) == (r["batch"] <= rows), r
    if rows:
        assert "instead of the small-GEMM kernel" in format_table(report)


def test_bad_grids_are_refused():
    with pytest.raises(ValueError):
        bench_roofline("tiny-llama", batches=())
    with pytest.raises(ValueError, match="too long"):
        bench_roofline("tiny-llama", batches=(1,), contexts=(1 << 20,))
