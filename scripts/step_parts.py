"""Where a CPU decode step's time goes: the engine's real runner on one decode step of
`--batch` requests at `--context` tokens (random KV, as `bench roofline` sets it up), with
each part's wall time summed over the step by wrapping its Python entry point. Parts nest
(an attention layer's time includes its projections), and the wrappers add ~1 us per call.
scripts/profile_steps.py gives torch's profile by operator instead, where the C kernels
(called through ctypes) do not show.

    python scripts/step_parts.py [--model smollm2-135m] [--batch 8] [--context 128]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from kernels import paged_decode_cpu
from pdserve import attention
from pdserve.bench.roofline import decode_chunks
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.models import deepseek, layers, llama, rope
from pdserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    spent: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()

    def wrap(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[label] += time.perf_counter() - start
                calls[label] += 1

        setattr(owner, name, timed)

    wrap(layers.Linear, "forward", "Linear (projections and head)")
    wrap(layers.RMSNorm, "forward", "RMSNorm")
    wrap(layers.GatedMLP, "forward", "GatedMLP (with its Linears)")
    wrap(llama.GQAAttention, "forward", "GQA attention layer (with its Linears)")
    wrap(deepseek.MLAAttention, "forward", "MLA attention layer (with its Linears)")
    wrap(rope.RotaryEmbedding, "forward", "RoPE")
    wrap(attention.TorchAttentionBackend, "write_kv", "KV write")
    wrap(attention.TorchAttentionBackend, "gqa", "attention")
    wrap(paged_decode_cpu, "paged_gqa_decode_cpu", "attention: the C kernel's call")

    block = 16
    per_request = -(-args.context // block)
    engine_args = EngineArgs(
        block_size=block,
        num_kv_blocks=args.batch * per_request + 1,
        enable_prefix_caching=False,
    )
    core, _ = build_engine(args.model, engine_args)
    try:
        core.kv_pool.normal_()
        tokens = [100 + i for i in range(args.batch)]
        chunks = decode_chunks(
            tokens, args.context, block, per_request, SamplingParams(temperature=0)
        )
        for _ in range(3):
            core.runner.execute(chunks)
        spent.clear()
        calls.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            core.runner.execute(chunks)
        step = (time.perf_counter() - start) / args.steps
    finally:
        core.close()
    print(
        f"{args.model}, batch {args.batch} x {args.context} tokens, "
        f"{torch.get_num_threads()} threads: step {step * 1e3:.1f} ms"
    )
    for label, seconds in spent.most_common():
        print(
            f"  {label:42s} {seconds / args.steps * 1e3:7.2f} ms  "
            f"({calls[label] // args.steps} calls a step)"
        )


if __name__ == "__main__":
    main()
