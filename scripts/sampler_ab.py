"""The engine's sampler (pdserve/engine/sampler.py) against the one it replaced, in the same
process: milliseconds per call for a grid of vocabularies, batch sizes and sampling
settings, on peaked logits (a real model's: the nucleus is a few hundred tokens) and on
flat ones (random weights: the nucleus is most of the vocabulary).

    python scripts/sampler_ab.py [--device cuda] [--json out.json]

The baseline (`per_row_multinomial`) is the previous algorithm, kept here only to measure
against: a full sort of every row for top-k / top-p, then one `torch.multinomial` per row
on the host.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from pdserve.bench.report import machine_info
from pdserve.engine.sampler import sample
from pdserve.sampling_params import SamplingParams

VOCABS = (49_152, 128_256)  # SmolLM2, Llama-3
BATCHES = (1, 8, 32)
SETTINGS = (  # each row's sampling parameters, cycled over the batch
    ("t=1", (dict(temperature=1.0),)),
    ("t=0.7 top_p=0.9", (dict(temperature=0.7, top_p=0.9),)),
    ("t=0.7 top_k=50", (dict(temperature=0.7, top_k=50),)),
    ("mixed", (dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(top_k=50))),
)
SPREADS = (("peaked", 4.0), ("flat", 1.0))  # std of the logits


def per_row_multinomial(logits, params, generators, default_generator) -> list[int]:
    greedy = logits.argmax(dim=-1)
    device, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    scaled = logits / temps[:, None]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)
    drop = ranks[None, :] >= top_k.clamp(max=vocab)[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    drop |= sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits).softmax(-1)
    out = greedy.tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            gen = generators[i] or default_generator
            out[i] = int(torch.multinomial(probs[i].cpu(), 1, generator=gen))
    return out


def _ms(fn, device: torch.device, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()  # returns host ints: the device work is done when it returns
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    print(
        f"{'spread':<7} {'vocab':>7} {'batch':>5} {'setting':<16} {'new ms':>8} {'old ms':>8} "
        f"{'speed-up':>8}"
    )
    for spread, std in SPREADS:
        for vocab in VOCABS:
            gen = torch.Generator(device).manual_seed(vocab)
            for batch in BATCHES:
                logits = torch.randn(batch, vocab, generator=gen, device=device) * std
                for name, kw in SETTINGS:
                    params = [SamplingParams(**kw[i % len(kw)]) for i in range(batch)]
                    nones = [None] * batch
                    engine = torch.Generator().manual_seed(0)
                    call = (logits, params, nones, engine)
                    new = _ms(functools.partial(sample, *call), device)
                    old = _ms(functools.partial(per_row_multinomial, *call), device)
                    rows.append(
                        dict(
                            spread=spread,
                            vocab=vocab,
                            batch=batch,
                            setting=name,
                            new_ms=new,
                            old_ms=old,
                            speedup=old / new,
                        )
                    )
                    print(
                        f"{spread:<7} {vocab:>7} {batch:>5} {name:<16} {new:>8.2f} {old:>8.2f} "
                        f"{old / new:>7.1f}x"
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": str(device),
                    "threads": torch.get_num_threads(),
                    "machine": machine_info(),
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
