"""`pdserve bench roofline`: decode steps against the memory roofline of this machine.

A decode step must read every weight the step uses once (all but the input embedding
table, of which it reads a row per request; a tied table is read whole as the LM head)
and the KV of every request's context. Its floor on this machine is those bytes over the
memory read bandwidth, measured in the same run (a multi-threaded sum over a buffer far
larger than the caches, best of several). For each batch size and context in the grid the
benchmark times real decode steps of the engine's runner (pdserve/engine/model_runner.py,
the path every role runs) and reports step time, roofline time and their ratio: the
fraction of the roofline the step reaches (1.0 = as fast as reading the bytes once).

A step also has a compute floor: its FLOPs (2 per weight element per request for the
projections and the LM head, 2 per query head per context token per K and V dimension for
attention) at the peak rate this machine's matrix multiply reaches, measured in the same run
with the model's own Linear (the path its projections take) on a large fp32 product. The
roofline bound is the larger of the two floors; where compute is the larger (batches of many
requests on a CPU), no kernel reaches the memory floor, and the report says so per point
(`bound_by`).

The contexts are not prefilled (64 prompts of 2,048 tokens would take minutes on a CPU):
each request's blocks are simply there, holding random KV, and its step is one token at
position context-1, as a decode step at that context is. The time of a step does not
depend on what the cache holds.

On a CPU, where a step's few-row projections go through pdserve's C kernel
(kernels/small_gemm_cpu.py), each such point is timed again with the kernel off (torch's
oneDNN or MKL product), in the same run: `torch_linear_step_s`, what the kernel is worth.
"""

from __future__ import annotations

import statistics
import time

import torch

from pdserve.bench.report import machine_info
from pdserve.engine.args import EngineArgs
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.build import build_engine
from pdserve.models.layers import Linear
from pdserve.progress import progress
from pdserve.sampling_params import SamplingParams

BATCHES = (1, 8, 16, 32, 64)
CONTEXTS = (128, 512, 1024, 2048)
BANDWIDTH_BYTES = 1 << 30  # the buffer the bandwidth is read from (1 GiB)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def read_bandwidth(device: torch.device, nbytes: int = BANDWIDTH_BYTES, reps: int = 5) -> float:
    """Bytes per second a reduction over `nbytes` reads at best (the torch threads set)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(reps + 1):  # the first pass is a warm-up
        _sync(device)
        start = time.perf_counter()
        buf.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    del buf
    return nbytes / best


def matmul_flops(device: torch.device, dtype: torch.dtype, reps: int = 5) -> float:
    """FLOP/s of the model's Linear (packed as the engine packs it) on a [512, 2048] x
    [2048, 2048] product, at best (the torch threads set)."""
    from pdserve.models.layers import Linear

    with torch.device(device):
        layer = Linear(2048, 2048, bias=False).to(dtype).requires_grad_(False)
        x = torch.randn(512, 2048, dtype=dtype)
    layer.pack_for_cpu()
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps + 1):  # the first pass is a warm-up
            _sync(device)
            start = time.perf_counter()
            layer(x)
            _sync(device)
            best = min(best, time.perf_counter() - start)
    return 2 * 512 * 2048 * 2048 / best


def step_flops(model: torch.nn.Module, config, batch: int, context: int) -> int:
    """Projections and LM head: 2 FLOPs per weight element of every Linear per request (an
    MoE model counts every expert: too many). Attention: per layer, per query head, 2 per
    context token for the scores and 2 for the weighted values per head dimension."""
    from pdserve.models.layers import Linear

    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
    dims = (
        config.head_dim * 2
        if config.mla is None
        else 2 * config.mla.kv_lora_rank + (config.mla.qk_rope_head_dim)
    )
    attention = 2 * config.num_layers * config.num_heads * context * dims
    return batch * (2 * linear + attention)


def weight_bytes_read(model: torch.nn.Module) -> int:
    """What one decode step reads of the weights: every parameter (shared ones once) but an
    untied input embedding table. For a mixture-of-experts model that counts every expert,
    which a small batch does not touch: there the roofline is too slow, the fraction too high."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if model.lm_head.weight.data_ptr() != embed.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def decode_chunks(
    tokens: list[int], context: int, block_size: int, per_request: int, params: SamplingParams
) -> list[ScheduledChunk]:
    """One decode step of len(tokens) requests at `context` tokens each: request i owns
    blocks 1 + i * per_request onward (block 0 stays out: the runner pads block tables
    with it), whatever KV they hold."""
    blocks = -(-context // block_size)
    return [
        ScheduledChunk(
            token_ids=[token],
            start=context - 1,
            block_ids=list(range(1 + i * per_request, 1 + i * per_request + blocks)),
            sample=True,
            params=params,
            generator=None,
        )
        for i, token in enumerate(tokens)
    ]


def _hold_onednn_copies(model: torch.nn.Module) -> bool:
    """Where the model's Linears multiply by panels (only where torch has oneDNN's packed
    product: see Linear.pack_for_cpu), give each one oneDNN's copy too (what
    `Linear.panel_products = False` then runs): True if so."""
    from pdserve.models.layers import onednn_pack

    linears = [m for m in model.modules() if isinstance(m, Linear) and m.panels is not None]
    for m in linears:
        m.packed = onednn_pack(m.weight)
    return bool(linears)


def _median_step(runner, chunks, steps: int, device: torch.device) -> float:
    times = []
    for s in range(steps + 1):  # the first is a warm-up (and captures a CUDA graph)
        _sync(device)
        start = time.perf_counter()
        runner.execute(chunks)
        _sync(device)
        if s:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_roofline(
    model: str = "smollm2-135m",
    batches: tuple[int, ...] = BATCHES,
    contexts: tuple[int, ...] = CONTEXTS,
    steps: int = 3,
    seed: int = 0,
    bandwidth_bytes: int = BANDWIDTH_BYTES,
) -> dict:
    """`bandwidth_bytes`: the buffer the read bandwidth is measured over (far larger than
    the caches, else the figure is the caches')."""
    if not batches or not contexts or min(batches) < 1 or min(contexts) < 2 or steps < 1:
        raise ValueError("batches and steps >= 1, contexts >= 2 tokens")
    from pdserve.weights import resolve

    if max(contexts) > (positions := resolve(model).config.max_position):
        raise ValueError(f"contexts: {max(contexts)} is too long for {model} ({positions})")
    block_size = 16
    per_request = -(-max(contexts) // block_size)
    args = EngineArgs(
        block_size=block_size,
        num_kv_blocks=max(batches) * per_request + 1,
        enable_prefix_caching=False,
        seed=seed,
    )
    core, _ = build_engine(model, args)
    try:
        device = core.kv_pool.device
        core.kv_pool.normal_()  # touch every page: no first-touch faults in a timed step
        bandwidth = read_bandwidth(device, bandwidth_bytes)
        flops_per_s = matmul_flops(device, core.kv_pool.dtype)
        weights = weight_bytes_read(core.runner.model)
        # where the panel kernel runs, each point is timed again on the path it replaced
        # (the few-row kernel to its rows, oneDNN's packed product past them): both copies
        # of the weights are held for the run; where the few-row kernel runs instead, each
        # of its points is timed again without it
        model_dtype = next(core.runner.model.parameters()).dtype
        panels = _hold_onednn_copies(core.runner.model)
        kernel_rows = 0 if panels else Linear.kernel_rows(device, model_dtype)
        kv_per_token = core.model_config.kv_elements_per_token * core.kv_pool.element_size()
        vocab = core.model_config.vocab_size
        gen = torch.Generator().manual_seed(seed)
        params = SamplingParams(temperature=0)
        rows = []
        grid = [(b, c) for c in contexts for b in batches]
        for batch, context in progress(grid, desc="bench roofline", unit="point"):
            tokens = torch.randint(3, vocab, (batch,), generator=gen).tolist()
            chunks = decode_chunks(tokens, context, block_size, per_request, params)
            graphs, eager = getattr(core.runner, "graphs", None), None
            replays = graphs.replays if graphs is not None else 0
            step = _median_step(core.runner, chunks, steps, device)
            # on CUDA the engine replays decode steps from CUDA graphs: the same step
            # eagerly, in the same run, says what the graphs are worth
            if graphs is not None:
                replays = graphs.replays - replays  # 0: this point ran eagerly too
                core.runner.graphs = None
                try:
                    eager = _median_step(core.runner, chunks, steps, device)
                finally:
                    core.runner.graphs = graphs
            previous_linear = torch_linear = None
            if panels:
                on, Linear.panel_products = Linear.panel_products, False
                try:
                    previous_linear = _median_step(core.runner, chunks, steps, device)
                finally:
                    Linear.panel_products = on
            # the same step with the few-row products on torch's path, where the kernel ran
            if 0 < batch <= kernel_rows:
                native_rows = Linear.native_rows
                Linear.native_rows = 0
                try:
                    torch_linear = _median_step(core.runner, chunks, steps, device)
                finally:
                    Linear.native_rows = native_rows
            nbytes = weights + batch * context * kv_per_token
            floor = nbytes / bandwidth
            flops = step_flops(core.runner.model, core.model_config, batch, context)
            compute = flops / flops_per_s
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "step_s": step,
                    "bytes_read": nbytes,
                    "roofline_s": floor,  # the memory floor
                    "fraction_of_roofline": floor / step,
                    "flops": flops,
                    "compute_s": compute,  # the compute floor
                    "bound_s": max(floor, compute),
                    "fraction_of_bound": max(floor, compute) / step,
                    "bound_by": "memory" if floor >= compute else "compute",
                    "tok_s": batch / step,
                    "eager_step_s": eager,  # None: no CUDA graphs (CPU)
                    "graph_replays": replays,
                    "torch_linear_step_s": torch_linear,  # None: the kernel did not run
                    # None: no panel kernel (or no oneDNN to compare with)
                    "previous_linear_step_s": previous_linear,
                }
            )
    finally:
        core.close()
    return {
        "benchmark": "roofline",
        "model": model,
        "device": str(device),
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "matmul_gflop_s": flops_per_s / 1e9,
        "attention_backend": core.runner.backend.name,
        "small_gemm_rows": kernel_rows,
        "panel_gemm": panels,
        "cuda_graphs": core.runner.graphs.stats() if getattr(core.runner, "graphs", None) else None,
        "weight_bytes_read": weights,
        "kv_bytes_per_token": kv_per_token,
        "steps": steps,
        "machine": machine_info(),
        "rows": rows,
    }


def format_table(report: dict) -> str:
    contexts = sorted({r["context"] for r in report["rows"]})
    batches = sorted({r["batch"] for r in report["rows"]})
    at = {(r["batch"], r["context"]): r for r in report["rows"]}
    lines = [
        f"bench roofline: {report['model']} on {report['device']}, read bandwidth "
        f"{report['read_bandwidth_gb_s']:.1f} GB/s (measured), weights read per step "
        f"{report['weight_bytes_read'] / 1e6:.0f} MB, KV {report['kv_bytes_per_token'] / 1e3:.1f}"
        " KB/token",
        f"matmul {report['matmul_gflop_s']:.0f} GFLOP/s (measured), attention backend "
        f"{report['attention_backend']}",
        "step ms (fraction of the memory floor / of the larger of the memory and compute"
        " floors, m or c: which is larger) by batch and context:",
        f"{'batch':>6} " + " ".join(f"{c:>22}" for c in contexts),
    ]
    for b in batches:
        cells = []
        for c in contexts:
            r = at.get((b, c))
            cells.append(
                f"{r['step_s'] * 1e3:>7.1f} ({r['fraction_of_roofline']:.2f}/"
                f"{r['fraction_of_bound']:.2f} {r['bound_by'][0]})"
                if r
                else ""
            )
        lines.append(f"{b:>6} " + " ".join(f"{cell:>22}" for cell in cells))
    if any(r.get("eager_step_s") for r in report["rows"]):
        lines.append(f"the same steps eagerly, ms (CUDA graphs' speed-up): {report['cuda_graphs']}")
        for b in batches:
            cells = [
                f"{r['eager_step_s'] * 1e3:>7.1f} ({r['eager_step_s'] / r['step_s']:.2f}x)"
                if (r := at.get((b, c))) and r.get("eager_step_s")
                else ""
                for c in contexts
            ]
            lines.append(f"{b:>6} " + " ".join(f"{cell:>22}" for cell in cells))
    for key, title in (
        (
            "previous_linear_step_s",
            "the same steps on the products the panel kernel replaced (the few-row kernel,"
            " oneDNN past its rows), ms (the panel kernel's speed-up):",
        ),
        (
            "torch_linear_step_s",
            "the same steps with torch's products instead of the small-GEMM kernel, ms"
            " (its speed-up):",
        ),
    ):
        if not any(r.get(key) for r in report["rows"]):
            continue
        lines.append(title)
        for b in batches:
            cells = [
                f"{t * 1e3:>7.1f} ({t / r['step_s']:.2f}x)"
                if (r := at.get((b, c))) and (t := r.get(key))
                else ""
                for c in contexts
            ]
            if any(cells):
                lines.append(f"{b:>6} " + " ".join(f"{cell:>22}" for cell in cells))
    return "\n".join(lines)
