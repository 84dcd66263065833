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
  long-prompt the reasoning outputs after prompts uniform in [192, 320] tokens: contexts
              long enough that recomputing a preempted request costs several decode
              steps on a CPU (`pdserve bench preempt-cost`), where the trap shows.
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
WORKLOADS = (*TRACE_SCALES, "uniform", "reasoning", "long-prompt")
REASONING_SIGMA = 1.0
PROMPT_RANGE = MappingProxyType({"reasoning": (16, 48), "long-prompt": (192, 320)})


def max_prompt_tokens(kind: str) -> int:
    """The longest prompt a workload kind draws."""
    if kind in PROMPT_RANGE:
        return PROMPT_RANGE[kind][1]
    if kind in TRACE_SCALES:
        return TRACE_CLIP[0][1]
    if kind == "uniform":
        return 256
    raise ValueError(f"workload: unknown {kind!r}; choose one of {', '.join(WORKLOADS)}")


def scale_lengths(kind: str, prompt: int, output: int) -> tuple[int, int]:
    (p_lo, p_hi), (o_lo, o_hi) = TRACE_CLIP
    fp, fo = TRACE_SCALES[kind]
    return min(max(round(prompt * fp), p_lo), p_hi), min(max(round(output * fo), o_lo), o_hi)


def reasoning_lengths(
    n: int,
    gen: torch.Generator,
    mean_output: int,
    max_output: int | None = None,
    prompts: tuple[int, int] = PROMPT_RANGE["reasoning"],
) -> list[tuple[int, int]]:
    cap = max_output if max_output is not None else 4 * mean_output
    # lognormal: mean = exp(mu + sigma^2 / 2)
    mu = math.log(mean_output) - REASONING_SIGMA**2 / 2
    out = []
    for _ in range(n):
        prompt = int(torch.randint(prompts[0], prompts[1] + 1, (), generator=gen))
        z = torch.randn((), generator=gen).item()
        length = int(round(math.exp(mu + REASONING_SIGMA * z)))
        out.append((prompt, min(max(length, 8), cap)))
    return out


def _lengths(
    kind: str,
    n: int,
    gen: torch.Generator,
    mean_output: int = 128,
    max_output: int | None = None,
    native: bool = False,
) -> list[tuple[int, int]]:
    if kind in PROMPT_RANGE:
        return reasoning_lengths(n, gen, mean_output, max_output, PROMPT_RANGE[kind])
    if kind in TRACE_SCALES:
        trace = trace_requests(kind)
        picks = torch.randint(0, len(trace), (n,), generator=gen).tolist()
        if native:  # as recorded (a simulated GPU serves them at full length)
            return [(max(trace[i].prompt_tokens, 1), max(trace[i].output_tokens, 1)) for i in picks]
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


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload file: when it arrives and how long it is."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def load_jsonl(path: str) -> list[RequestSpec]:
    """A workload file: one JSON object a line, `{"arrival_s": 0.0, "prompt_tokens": 120,
    "output_tokens": 900}` (arrival_s optional, default 0; blank lines skipped). Every row
    is checked before anything runs; a bad one raises ValueError naming its line and field."""
    import json

    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        raise ValueError(f"workload: cannot read {path!r} ({e.strerror})") from None
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"workload {path}:{no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object")
        for name in ("prompt_tokens", "output_tokens"):
            value = row.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {name}: a positive integer is required, got {value!r}")
        arrival = row.get("arrival_s", 0.0)
        if (
            isinstance(arrival, bool)
            or not isinstance(arrival, (int, float))
            or not math.isfinite(arrival)
            or arrival < 0
        ):
            raise ValueError(
                f"{where}: arrival_s: a finite number >= 0 is required, got {arrival!r}"
            )
        out.append(RequestSpec(float(arrival), row["prompt_tokens"], row["output_tokens"]))
    if not out:
        raise ValueError(f"workload {path}: no requests")
    return out


def specs_of(
    kind: str,
    n: int,
    seed: int,
    mean_output: int = 128,
    max_output: int | None = None,
    native: bool = False,
) -> list[RequestSpec]:
    """n RequestSpecs (all arriving at 0) of a built-in workload kind; `native`: trace
    lengths as recorded instead of scaled to a small model on a CPU."""
    gen = torch.Generator().manual_seed(seed)
    lengths = _lengths(kind, n, gen, mean_output, max_output, native)
    return [RequestSpec(0.0, p, o) for p, o in lengths]


def prompts_for(specs: list[RequestSpec], vocab: int, seed: int) -> list[list[int]]:
    """Random prompt token ids of each spec's length (ordinary tokens of the upper vocab)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(vocab // 4, vocab, (s.prompt_tokens,), generator=gen).tolist() for s in specs
    ]
