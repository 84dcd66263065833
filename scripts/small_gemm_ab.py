"""The CPU products of a decode step against each other, in the same process: one decode
step's worth of a model's projections and LM head: every Linear of the model as the engine
loads it, so as large as its weights (read from memory, not the caches), for a grid of row
counts. Paths: the few-row kernel (`kernel`, kernels/small_gemm_cpu.py, on the weight in
place), oneDNN's packed product (`onednn`, each Linear's own copy), the panel kernel
(`panel`, kernels/panel_gemm_cpu.py, each Linear's panels: what layers.Linear runs by
default) and torch's plain `x @ w.T` (`mkl`).

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

from kernels import panel_gemm_cpu, small_gemm_cpu
from pdserve.bench.report import machine_info
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.models.layers import ONEDNN_LINEAR, Linear, onednn_pack


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
    core, _ = build_engine(args.model, EngineArgs(num_kv_blocks=4, enable_prefix_caching=False))
    core.close()  # the model stays: its Linears are what is timed
    linears = [m for m in core.runner.model.modules() if isinstance(m, Linear)]
    if not all(m.weight.dtype == torch.float32 for m in linears):
        raise SystemExit(f"{args.model}: the kernel is for fp32 weights")
    weights = [m.weight.detach() for m in linears]
    # the engine packs its Linears for the panel kernel (or, without it, for oneDNN): each
    # copy the other way is made here, for this comparison only
    panels = [m.panels for m in linears] if all(m.panels is not None for m in linears) else None
    if panels is None and panel_gemm_cpu.available():
        panels = [panel_gemm_cpu.pack(w) for w in weights]
    packed = [m.packed for m in linears] if all(m.packed is not None for m in linears) else None
    if packed is None and ONEDNN_LINEAR:
        packed = [onednn_pack(w) for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    paths = {
        "kernel": lambda x, i: small_gemm_cpu.small_gemm(x, weights[i]),
        "mkl": lambda x, i: x @ weights[i].T,
    }
    if packed is not None:
        paths["onednn"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(
            x, packed[i], None, "none", [], ""
        )
    if panels is not None:
        paths["panel"] = lambda x, i: panel_gemm_cpu.try_panel_gemm(
            x, panels[i], weights[i].shape[0], None
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
        vs = " ".join(
            f"{a}/{b} {point[f'{a}_s'] / point[f'{b}_s']:.2f}"
            for a, b in (("kernel", "onednn"), ("panel", "onednn"), ("panel", "kernel"))
            if a in paths and b in paths
        )
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
