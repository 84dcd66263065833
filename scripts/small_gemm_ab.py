"""The few-row CPU product (kernels/small_gemm_cpu.py) against torch's, in the same process:
one decode step's worth of a model's projections and LM head, with distinct random weights
of the model's shapes (as large as its weights, so that they are read from memory, not the
caches), for a grid of row counts. Paths: the kernel, oneDNN's packed product (what
layers.Linear runs past the kernel's rows) and torch's plain `x @ w.T` (MKL).

    python scripts/small_gemm_ab.py [--model smollm2-135m] [--rows 1,2,4,8,12,16,24,32] \
        [--json out.json]

Every path's result is checked against a float64 product before it is timed; each time is
the best of `--reps` passes over all the weights.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kernels import small_gemm_cpu
from pdserve.bench.report import machine_info
from pdserve.models.layers import ONEDNN_LINEAR
from pdserve.weights import resolve


def step_shapes(model: str) -> list[tuple[int, int]]:
    """(out, in) of every Linear a dense model's decode step multiplies by: per layer the
    fused q/k/v, o, fused gate/up and down projections, then the LM head."""
    c = resolve(model).config
    if c.mla is not None or c.moe is not None:
        raise ValueError(f"{model}: dense GQA models only")
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = [
        (q + 2 * kv, c.hidden_size),
        (c.hidden_size, q),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]
    return layer * c.num_layers + [(c.vocab_size, c.hidden_size)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,2,4,8,12,16,24,32")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not small_gemm_cpu.available():
        raise SystemExit("the small-GEMM kernel does not build here (no C compiler?)")
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for n, k in step_shapes(args.model)]
    packed = (
        [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights] if ONEDNN_LINEAR else None
    )
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    paths = {
        "kernel": lambda x, i: small_gemm_cpu.small_gemm(x, weights[i]),
        "mkl": lambda x, i: x @ weights[i].T,
    }
    if packed is not None:
        paths["onednn"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(
            x, packed[i], None, "none", [], ""
        )
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen) for k in {w.shape[1] for w in weights}}
        point = {"rows": rows}
        for name, fn in paths.items():
            for i in (0, 1, 2, 3, len(weights) - 1):  # each shape once, against float64
                x, w = xs[weights[i].shape[1]], weights[i]
                ref = x.double() @ w.double().T
                err = (fn(x, i).double() - ref).abs().max().item()
                if err > 1e-4 * w.shape[1] ** 0.5:
                    raise SystemExit(f"{name} at {rows} rows, {tuple(w.shape)}: error {err}")
            best = float("inf")
            with torch.inference_mode():
                for _ in range(args.reps):
                    start = time.perf_counter()
                    for i, w in enumerate(weights):
                        fn(xs[w.shape[1]], i)
                    best = min(best, time.perf_counter() - start)
            point[f"{name}_s"] = best
            point[f"{name}_gb_s"] = nbytes / best / 1e9
        rows_out.append(point)
        cells = "  ".join(f"{n} {point[f'{n}_s'] * 1e3:6.1f} ms" for n in paths)
        vs = f"kernel/onednn {point['kernel_s'] / point['onednn_s']:.2f}" if packed else ""
        print(f"rows {rows:3d}  {cells}  {vs}", flush=True)
    report = {
        "benchmark": "small_gemm_ab",
        "model": args.model,
        "weight_bytes": nbytes,
        "threads": torch.get_num_threads(),
        "machine": machine_info(),
        "points": rows_out,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
