"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Logits are filtered in one batched pass; the final draw uses each request's own generator
when it has a seed, so a seeded request samples the same tokens whatever else is batched.
"""

from __future__ import annotations

import torch

from pdserve.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,  # [N, vocab] fp32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> list[int]:
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy.tolist()
    device = logits.device
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    scaled = logits / temps[:, None]
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    probs = _filtered_probs(scaled, top_k.clamp(max=vocab), top_p)
    out = greedy.tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        gen = generators[i] or default_generator
        # multinomial on CPU keeps seeded draws identical across devices
        out[i] = int(torch.multinomial(probs[i].cpu(), 1, generator=gen))
    return out


def _filtered_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    drop = ranks[None, :] >= top_k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return filtered.softmax(dim=-1)


def top_logprobs(logits: torch.Tensor, k: int) -> dict[int, float]:
    """The k most likely tokens of one row of logits with their log-probabilities."""
    values, ids = logits.log_softmax(dim=-1).topk(k)
    return dict(zip(ids.tolist(), values.tolist()))
