"""`pdserve bench preempt-cost`: what one preemption costs on this machine, in decode steps.

The capacity trap is a ratio: a preempted request's KV is either computed again (one
prefill of its whole context) or spilled and reloaded (two copies through a tier), and
either costs the running batch the decode steps it could have taken meanwhile. For each
context length L this measures, in one engine and one process:

    decode step   one step of `batch` requests, each at context L (median of `steps`)
    recompute     the prefill of one L-token context (what recompute preemption redoes)
    swap          a park + unpark of that context's blocks through the host tier (what
                  swap/tiered preemption does: pdserve/kv/offload.py)

and reports recompute and swap in decode steps (and in tokens the batch could have made).
Where recompute costs many steps and swap few, recompute preemption collapses throughput
and spilling escapes it; where both cost about a step, preemption policy barely matters for
throughput (only for tail latency). Requests use random token ids and run to their length.
"""

from __future__ import annotations

import statistics
import time

import torch

from pdserve.bench.report import machine_info
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.engine.core import EngineCore
from pdserve.progress import progress
from pdserve.sampling_params import SamplingParams


def _sync(core: EngineCore) -> None:
    if core.kv_pool.device.type == "cuda":
        torch.cuda.synchronize()


def _timed_step(core: EngineCore) -> tuple[float, int]:
    """-> (seconds, requests that ran)."""
    start = time.perf_counter()
    out = core.step()
    _sync(core)
    return time.perf_counter() - start, len(out.ran)


def _prompt(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(vocab // 4, vocab, (n,), generator=gen).tolist()


def bench_preempt_cost(
    model: str = "smollm2-135m",
    contexts: tuple[int, ...] = (256, 1024, 2048),
    batch: int = 8,
    steps: int = 5,
    reps: int = 3,
    seed: int = 0,
) -> dict:
    if not contexts or min(contexts) < 2 or batch < 1 or steps < 1 or reps < 1:
        raise ValueError("contexts >= 2 tokens, batch, steps and reps >= 1")
    block_size = 16
    # room for the batch at its longest (prefilling takes a few steps at long contexts)
    blocks = (batch + 1) * (-(-(max(contexts) + steps + 2 + 8 * batch) // block_size)) + 8
    args = EngineArgs(
        block_size=block_size,
        num_kv_blocks=blocks,
        max_num_batched_tokens=max(2048, max(contexts)),
        enable_prefix_caching=False,  # every prefill computes its whole context
        preemption="swap",
        spill_host_blocks=blocks,
        seed=seed,
    )
    core, _ = build_engine(model, args)
    if max(contexts) + steps + 2 > core.validator.max_model_len:
        raise ValueError(f"contexts: {max(contexts)} is too long for {model}")
    vocab, gen = core.model_config.vocab_size, torch.Generator().manual_seed(seed)
    rows = []
    try:
        for length in progress(list(contexts), desc="bench preempt-cost", unit="context"):
            # recompute: the prefill of one whole context (a warm-up first)
            prefill = []
            for r in range(reps + 1):
                core.add(
                    core.make_request(_prompt(gen, vocab, length), SamplingParams(max_tokens=1))
                )
                elapsed, _ = _timed_step(core)
                assert not core.has_unfinished
                if r:
                    prefill.append(elapsed)
            # a decode step of `batch` requests at this context
            # (long contexts take several steps to prefill: the first requests decode
            # meanwhile, so every request may run well past `steps` tokens)
            budget = core.token_budget
            extra = -(-batch * length // budget) + 2  # steps it takes to prefill them all
            params = SamplingParams(max_tokens=steps + 2 + extra, ignore_eos=True)
            reqs = [core.make_request(_prompt(gen, vocab, length), params) for _ in range(batch)]
            for req in reqs:
                core.add(req)
            while core.stats().running < batch or any(r.num_output_tokens == 0 for r in reqs):
                core.step()  # prefill every prompt (a few per step within the budget)
            core.step()  # a first decode step of all of them (warm-up)
            decode = []
            for _ in range(steps):
                elapsed, ran = _timed_step(core)
                assert ran == batch
                decode.append(elapsed)
            for req in reqs:
                core.abort(req.request_id)
            # swap: park one context's blocks in the host tier and bring them back
            kv = core.kv
            ids = kv.allocate_fresh(kv.blocks_needed(length))
            spill, reload = [], []
            for r in range(reps + 1):
                start = time.perf_counter()
                assert kv.park("cost", ids)
                middle = time.perf_counter()
                assert kv.unpark("cost", ids)
                _sync(core)
                if r:
                    spill.append(middle - start)
                    reload.append(time.perf_counter() - middle)
            kv.free(ids)
            step = statistics.median(decode)
            recompute = statistics.median(prefill)
            swap = statistics.median(spill) + statistics.median(reload)
            rows.append(
                {
                    "context": length,
                    "batch": batch,
                    "decode_step_s": step,
                    "recompute_s": recompute,
                    "spill_s": statistics.median(spill),
                    "reload_s": statistics.median(reload),
                    "recompute_steps": recompute / step,
                    "swap_steps": swap / step,
                    "recompute_tokens_lost": batch * recompute / step,
                    "swap_tokens_lost": batch * swap / step,
                    "kv_bytes": len(ids)
                    * core.kv_pool.numel()
                    * core.kv_pool.element_size()
                    // core.num_blocks,
                }
            )
            core.check_integrity()
    finally:
        core.close()
    return {
        "benchmark": "preempt-cost",
        "model": model,
        "device": str(core.kv_pool.device),
        "machine": machine_info(),
        "rows": rows,
    }


def format_table(report: dict) -> str:
    lines = [
        f"what one preemption costs, {report['model']} on {report['device']} "
        f"(in decode steps of the batch; tokens the batch could have made meanwhile)",
        f"{'context':>7} {'batch':>5} {'step ms':>8} {'recompute ms':>12} {'steps':>6} "
        f"{'tokens':>7} {'swap ms':>8} {'steps':>6} {'tokens':>7} {'KV MiB':>7}",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['context']:>7} {r['batch']:>5} {r['decode_step_s'] * 1e3:>8.1f} "
            f"{r['recompute_s'] * 1e3:>12.1f} {r['recompute_steps']:>6.1f} "
            f"{r['recompute_tokens_lost']:>7.0f} {(r['spill_s'] + r['reload_s']) * 1e3:>8.1f} "
            f"{r['swap_steps']:>6.2f} {r['swap_tokens_lost']:>7.1f} {r['kv_bytes'] / 2**20:>7.1f}"
        )
    return "\n".join(lines)
