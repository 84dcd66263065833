"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Greedy rows take the argmax. The sampled rows are drawn in one batched pass by inverse CDF:
each row's probabilities (after temperature, and top-k / top-p where asked) are summed up
and one uniform number per row picks the token where the running sum passes it. That
number comes from the request's own generator when it has a seed (else the engine's), one
draw per token, so a seeded request samples the same tokens whatever else is batched; the
draw is made on the host, so the same seed gives the same number on any device (tokens
agree across devices unless it falls within rounding of a boundary of the running sum).

Rows without top-k or top-p need no sorting: a softmax over the vocabulary. Rows with them
work on their candidates in descending order: `topk` of the largest k asked for (linear in
the vocabulary), or a full sort when some row has top-p without top-k.

The per-row draw over the whole vocabulary that this replaces (a sort of every row, then one
`torch.multinomial` per row on the host) cost 61 ms for one row and 480 ms for 32 rows of
SmolLM2's 49,152-token vocabulary on 2 vCPUs, and ~150 ms per step of 32 rows of Llama-3's
128,256 on one H200 box: more than the decode step itself (docs/benchmarks.md).
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
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return greedy.tolist()
    device, vocab = logits.device, logits.shape[-1]
    # one uniform per sampled row, from its own generator: first, in row order, so the
    # engine's generator advances the same way whatever the rest of the step does
    uniform = [float(torch.rand((), generator=generators[i] or default_generator)) for i in rows]
    sampled = [params[i] for i in rows]
    temps = torch.tensor([p.temperature for p in sampled], device=device)
    scaled = logits[torch.tensor(rows, device=device)] / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in sampled]
    top_p = [p.top_p for p in sampled]
    if max(top_p) >= 1.0 and min(top_k) >= vocab:
        probs, ids = scaled.softmax(dim=-1), None  # nothing to filter: no sort
    else:
        probs, ids = _candidates(scaled, top_k, top_p)
    picked = _inverse_cdf(probs, torch.tensor(uniform, device=device))
    if ids is not None:
        picked = ids.gather(1, picked[:, None])[:, 0]
    out = greedy.tolist()
    for i, token in zip(rows, picked.tolist()):
        out[i] = token
    return out


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The index of each row where its running sum first exceeds uniform x the row's total
    (a token of probability 0 is never picked: the sum does not rise there)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(
        uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total))
    )
    return torch.searchsorted(cdf, target, right=True)[:, 0]


# candidates taken first for rows with top-p but no top-k: in a real model's distribution
# the nucleus is a few hundred tokens at most; a row whose NUCLEUS_FIRST best fall short of
# its top-p sends the step to a full sort
NUCLEUS_FIRST = 1024


def _candidates(
    scaled: torch.Tensor, top_k: list[int], top_p: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (probabilities [R, C] of each row's candidates in descending order, zero past its
    top-k / top-p cut, and their token ids [R, C])."""
    vocab, device = scaled.shape[-1], scaled.device
    k = torch.tensor(top_k, device=device)
    p = torch.tensor(top_p, device=device, dtype=scaled.dtype)
    unbounded = k >= vocab  # rows without a top-k: normalised over the whole vocabulary
    lse_all = scaled.logsumexp(dim=-1)
    width = max((x for x in top_k if x < vocab), default=0)  # the widest top-k asked
    if max(top_k) >= vocab:  # and room for the nucleus of the rows without one
        width = min(vocab, max(width, NUCLEUS_FIRST))
    if width < vocab:
        values, ids = scaled.topk(width, dim=-1)  # sorted, descending: linear in the vocab
        held = (values.logsumexp(dim=-1) - lse_all).exp()  # mass of the candidates
        if bool(((held < p) & unbounded).any()):  # a nucleus wider than the candidates
            values, ids = scaled.sort(dim=-1, descending=True)
    else:
        values, ids = scaled.sort(dim=-1, descending=True)
    # rows without a top-k are normalised over the whole vocabulary, not their candidates
    return _filter_sorted(values, k, p, torch.where(unbounded, lse_all, float("nan"))), ids


def _filter_sorted(
    values: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    lse_all: torch.Tensor | None = None,
) -> torch.Tensor:
    """Descending logits [R, C] -> probabilities after top-k then top-p: the smallest prefix
    whose mass reaches top_p (the token crossing it included), renormalised. `lse_all`: a
    row's log-normaliser over the whole vocabulary where its candidates are only the best
    of it (NaN elsewhere, or None: each row normalised over its own top-k candidates)."""
    ranks = torch.arange(values.shape[-1], device=values.device)
    drop = ranks[None, :] >= top_k[:, None]
    lse = values.masked_fill(drop, float("-inf")).logsumexp(dim=-1)
    if lse_all is not None:
        lse = torch.where(lse_all.isnan(), lse, lse_all)
    probs = (values - lse[:, None]).exp().masked_fill(drop, 0.0)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def top_logprobs(logits: torch.Tensor, k: int) -> dict[int, float]:
    """The k most likely tokens of one row of logits with their log-probabilities."""
    values, ids = logits.log_softmax(dim=-1).topk(k)
    return dict(zip(ids.tolist(), values.tolist()))
