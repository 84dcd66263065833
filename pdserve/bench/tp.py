"""`pdserve bench tp`: decode step times of one model at TP=1 and at TP=k, in one process.

Each size is an `LLM(model, tensor_parallel_size=k)` (k = 1 is the plain engine), all of
them alive at once and measured in interleaved rounds (machines here are shared and noisy).
A point is B requests of `context` random prompt tokens generating `steps` tokens each, with
prefix caching off and a pool that holds them all (no preemption); its step time is the
median wall time of the engine steps in which every request decodes (prefill steps are
left out). On CPU the ranks split this process's threads (k = 2 on 2 cores: one thread
each), so no speedup is expected there: the figure is for the record, and for a GPU node.

The default model is Qwen2.5-0.5B's architecture with random weights (2 KV heads, so TP=2
divides it; SmolLM2-135M's 3 KV heads and 9 heads only split 3 ways).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.report import machine_info
from pdserve.progress import progress

DEFAULT_MODEL = "random:" + str(
    Path(__file__).parent.parent / "sim" / "configs" / "qwen2.5-0.5b.json"
)


def _step_times(llm: LLM, prompts: list[list[int]], steps: int) -> list[float]:
    """Wall seconds of each engine step in which all requests decode."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        llm.gate.offer(llm.core.make_request(p, params, field=f"prompts[{i}]"))
    times, started = [], set()  # requests with their first token (their prefill is done)
    while llm.gate.busy:
        decoding = len(started) == len(prompts)
        t = time.perf_counter()
        out = llm.gate.step()
        dt = time.perf_counter() - t
        if decoding and len(out.tokens) == len(prompts):
            times.append(dt)
        started.update(new.request_id for new in out.tokens)
    return times


def bench_tp(
    model: str = DEFAULT_MODEL,
    sizes: list[int] = (1, 2),
    batches: list[int] = (1, 8),
    context: int = 256,
    steps: int = 8,
    rounds: int = 2,
    seed: int = 0,
) -> dict:
    block = 16
    blocks = max(batches) * (-(-(context + steps + 1) // block)) + 8
    common = dict(
        num_kv_blocks=blocks,
        block_size=block,
        enable_prefix_caching=False,
        preemption="recompute",
        admission="greedy",
        max_num_batched_tokens=max(2048, context),
    )
    threads = torch.get_num_threads()
    engines = {}
    for k in sizes:
        torch.set_num_threads(threads)  # each size splits the same threads
        engines[k] = LLM(model, tensor_parallel_size=k, **common)
    memory = {k: [m.__dict__ for m in llm.memory()] for k, llm in engines.items()}
    vocab = engines[sizes[0]].model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    samples: dict[tuple[int, int], list[float]] = {}
    try:
        with progress(total=rounds * len(batches) * len(sizes), desc="bench tp") as bar:
            for _ in range(rounds):
                for b in batches:
                    prompts = [
                        torch.randint(3, vocab, (context,), generator=g).tolist() for _ in range(b)
                    ]
                    for k in sizes:
                        samples.setdefault((k, b), []).extend(
                            _step_times(engines[k], prompts, steps)
                        )
                        bar.update(1)
    finally:
        for llm in engines.values():
            llm.close()
        torch.set_num_threads(threads)
    base = sizes[0]
    points = []
    for b in batches:
        row = {"batch": b, "context": context}
        for k in sizes:
            row[f"tp{k}_step_ms"] = 1e3 * statistics.median(samples[(k, b)])
            row[f"tp{k}_steps_measured"] = len(samples[(k, b)])
        for k in sizes[1:]:
            row[f"tp{k}_over_tp{base}"] = row[f"tp{k}_step_ms"] / row[f"tp{base}_step_ms"]
        points.append(row)
    return {
        "benchmark": "tp",
        "model": model,
        "sizes": list(sizes),
        "threads": threads,
        "steps": steps,
        "rounds": rounds,
        "memory": memory,
        "points": points,
        "machine": machine_info(),
    }


def format_table(report: dict) -> str:
    sizes = report["sizes"]
    head = ["batch", "context", *(f"TP={k} ms/step" for k in sizes)]
    head += [f"TP={k}/TP={sizes[0]}" for k in sizes[1:]]
    lines = [" | ".join(head)]
    for p in report["points"]:
        cells = [str(p["batch"]), str(p["context"])]
        cells += [f"{p[f'tp{k}_step_ms']:.1f}" for k in sizes]
        cells += [f"{p[f'tp{k}_over_tp{sizes[0]}']:.2f}" for k in sizes[1:]]
        lines.append(" | ".join(cells))
    weights = {
        k: max(m["weight_bytes"] for m in ranks) / 2**20 for k, ranks in report["memory"].items()
    }
    lines.append(
        "weights per rank (MiB): " + ", ".join(f"TP={k}: {w:.0f}" for k, w in weights.items())
    )
    lines.append(
        f"{report['threads']} torch threads split over each group's ranks; "
        "median of decode-only steps, interleaved rounds"
    )
    return "\n".join(lines)
