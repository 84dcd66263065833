"""Benchmark workloads: request lengths drawn from public traces or a uniform mix.

Workloads (seeded; prompt token ids drawn at random from the vocabulary):
  azure-conv  (default) prompt and output lengths of requests sampled from the Azure 2023
              conversation trace, scaled to a small model on a CPU: prompt x 1/8 and output
              x 1/2, clipped to [4, 512] and [4, 256] tokens.
  azure-code, mooncake-conv  the same from the Azure code trace (x 1/8, x 1) and Mooncake's
              conversation trace (x 1/32, x 1/2).
  uniform     prompt lengths log-uniform in [8, 256], max_tokens uniform in [16, 128].
  reasoning   short prompts (uniform in [16, 48] tokens) and long-tailed outputs: lognormal
              with sigma 1 and mean `mean_output` (default 128; the sweep scales it to the
              KV budget), clipped to [8, max_output] (default 4 x mean; the sweep keeps
              every request under half a decode worker's pool). Requests run to their
              length (ignore_eos).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import torch

from pdserve.bench.traces import trace_requests


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_tokens)


# Trace lengths scaled to a small model on a CPU: (prompt factor, output factor).
TRACE_SCALES = MappingProxyType(
    {
        "azure-conv": (1 / 8, 1 / 2),
        "azure-code": (1 / 8, 1),
        "mooncake-conv": (1 / 32, 1 / 2),
    }
)
TRACE_CLIP = ((4, 512), (4, 256))
WORKLOADS = (*TRACE_SCALES, "uniform", "reasoning")
REASONING_SIGMA = 1.0


def scale_lengths(kind: str, prompt: int, output: int) -> tuple[int, int]:
    (p_lo, p_hi), (o_lo, o_hi) = TRACE_CLIP
    fp, fo = TRACE_SCALES[kind]
    return min(max(round(prompt * fp), p_lo), p_hi), min(max(round(output * fo), o_lo), o_hi)


def reasoning_lengths(
    n: int, gen: torch.Generator, mean_output: int, max_output: int | None = None
) -> list[tuple[int, int]]:
    cap = max_output if max_output is not None else 4 * mean_output
    # lognormal: mean = exp(mu + sigma^2 / 2)
    mu = math.log(mean_output) - REASONING_SIGMA**2 / 2
    out = []
    for _ in range(n):
        prompt = int(torch.randint(16, 49, (), generator=gen))
        z = torch.randn((), generator=gen).item()
        length = int(round(math.exp(mu + REASONING_SIGMA * z)))
        out.append((prompt, min(max(length, 8), cap)))
    return out


def _lengths(
    kind: str, n: int, gen: torch.Generator, mean_output: int = 128, max_output: int | None = None
) -> list[tuple[int, int]]:
    if kind == "reasoning":
        return reasoning_lengths(n, gen, mean_output, max_output)
    if kind in TRACE_SCALES:
        trace = trace_requests(kind)
        picks = torch.randint(0, len(trace), (n,), generator=gen).tolist()
        return [scale_lengths(kind, trace[i].prompt_tokens, trace[i].output_tokens) for i in picks]
    if kind == "uniform":
        lo, hi = math.log(8), math.log(256)
        return [
            (
                int(math.exp(lo + (hi - lo) * torch.rand((), generator=gen).item())),
                int(torch.randint(16, 129, (), generator=gen)),
            )
            for _ in range(n)
        ]
    raise ValueError(f"workload: unknown {kind!r}; choose one of {', '.join(WORKLOADS)}")


def make_workload(
    n: int,
    vocab: int,
    seed: int,
    kind: str = "azure-conv",
    mean_output: int = 128,
    max_output: int | None = None,
) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    prompts, max_tokens = [], []
    for length, new in _lengths(kind, n, gen, mean_output, max_output):
        # ids from the upper part of the vocabulary: ordinary tokens, no special ones
        prompts.append(torch.randint(vocab // 4, vocab, (length,), generator=gen).tolist())
        max_tokens.append(new)
    return Workload(prompts, max_tokens)
