"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Greedy rows take the argmax. The sampled rows are drawn in one batched pass by inverse CDF:
each row's probabilities (after temperature, and top-k / top-p where asked) are summed up in
token-id order and one uniform number per row picks the token where the running sum passes
it. That number comes from the request's own generator when it has a seed (else the
engine's), one draw per token, and every row walks its probabilities in token-id order
whatever path computed them, so a seeded request samples the same tokens whatever else is
batched. The draw is made on the host: the same seed gives the same number on any device
(tokens agree across devices unless it falls within rounding of a boundary of the sum).

Rows without top-k or top-p need no sorting: a softmax over the vocabulary. Rows with them
keep every token at least as likely as their cut: the k-th largest logit for top-k (`topk`
of the largest k asked), and for top-p the logit of the token whose running mass (in
descending order) first reaches p, found among the NUCLEUS_FIRST best or, when some row's
nucleus is wider, a full sort. The cut is a value, not a position, so tokens tied with it
are kept (at most a few more than k) and no row's tokens depend on how a sort orders ties
or on which path the rest of the step took.

The per-row draw that this replaces (a sort of every row, then one `torch.multinomial` per
row on the host) against this one, in one process (scripts/sampler_ab.py,
docs/results/sampler-ab-cpu.json, 2 vCPUs): 32 rows of SmolLM2's 49,152-token vocabulary at
temperature 1, 119.3 vs 6.0 ms; with top-p 0.9, 114.6 vs 16.0 ms; a mix of plain, top-p and
top-k rows 116.5 vs 17.6 ms (peaked logits; on flat ones, whose nucleus is most of the
vocabulary, top-p still sorts: 1.3-1.6x). On one H200 the first version of this sampler
(which walked sorted candidates) took 0.68 vs 155.8 ms for 32 rows of Llama-3's 128,256
(docs/results/gpu/sampler-ab-cuda.json): the old way cost more than the decode step.
"""

from __future__ import annotations

import torch

from kernels import decode_ops_cpu
from pdserve.sampling_params import SamplingParams


class NonFiniteLogits(RuntimeError):
    """A sampled row's logits sum to no finite, positive probability (a broken checkpoint or
    an overflow in the model): no token can be drawn, and the same step would fail again."""


def sample(
    logits: torch.Tensor,  # [N, vocab] fp32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> list[int]:
    greedy = decode_ops_cpu.argmax(logits)  # fp32 on CPU: rows over the threads
    if greedy is None:
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
    if len(rows) < len(params):  # index_select: a row copy (advanced indexing of a [N,
        # vocab] tensor took 2.5-12 ms at N = 16 on 2 CPUs, most of a 50 ms step)
        logits = logits.index_select(0, torch.tensor(rows, device=device))
    scaled = logits / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in sampled]
    top_p = [p.top_p for p in sampled]
    filtered = any(k < vocab or p < 1.0 for k, p in zip(top_k, top_p))
    probs = _filtered(scaled, top_k, top_p) if filtered else scaled.softmax(dim=-1)
    picked = _inverse_cdf(probs, torch.tensor(uniform, device=device)).tolist()
    out = greedy.tolist()
    for i, token in zip(rows, picked):
        if token >= vocab:
            raise NonFiniteLogits(f"sampling: row {i}'s logits are not finite numbers")
        out[i] = token
    return out


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The index of each row where its running sum first exceeds uniform x the row's total
    (a token of probability 0 is never picked: the sum does not rise there); `vocab` for a
    row whose total is not a finite, positive number."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(
        uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total))
    )
    picked = torch.searchsorted(cdf, target, right=True)[:, 0]
    broken = ~torch.isfinite(total[:, 0]) | (total[:, 0] <= 0)
    return torch.where(broken, probs.shape[-1], picked)


# candidates searched first for the top-p cut of rows without a top-k: in a real model's
# distribution the nucleus is a few hundred tokens at most; a row whose NUCLEUS_FIRST best
# fall short of its top-p sends the step to a full sort
NUCLEUS_FIRST = 1024


def _filtered(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Logits [R, V] -> probabilities [R, V] in token-id order after top-k, then top-p on
    what top-k kept (renormalised); `top_k[i]` >= V: none, `top_p[i]` = 1: none."""
    vocab, device = scaled.shape[-1], scaled.device
    neg_inf = torch.full((len(top_k),), float("-inf"), device=device)
    k = torch.tensor(top_k, device=device)
    widest = max((x for x in top_k if x < vocab), default=0)
    if widest:  # the k-th largest logit of each row with a top-k
        best = scaled.topk(widest, dim=-1).values
        kth = best.gather(1, (k.clamp(max=widest) - 1)[:, None])[:, 0]
        scaled = _below(scaled, torch.where(k < vocab, kth, neg_inf))
    p = torch.tensor(top_p, device=device, dtype=scaled.dtype)
    if min(top_p) < 1.0:  # the logit of the token whose running mass first reaches p
        lse = scaled.logsumexp(dim=-1, keepdim=True)
        values = scaled.topk(min(vocab, max(widest, NUCLEUS_FIRST)), dim=-1).values
        mass = (values - lse).exp().cumsum(dim=-1)
        if bool(((mass[:, -1] < p) & (p < 1.0)).any()):  # a nucleus wider than them
            values = scaled.sort(dim=-1, descending=True).values
            mass = (values - lse).exp().cumsum(dim=-1)
        crossing = (mass < p[:, None]).sum(dim=-1).clamp(max=values.shape[-1] - 1)
        cut = values.gather(1, crossing[:, None])[:, 0]
        scaled = _below(scaled, torch.where(p < 1.0, cut, neg_inf))
    return scaled.softmax(dim=-1)


def _below(logits: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """Each row's logits below its floor set to -inf (a token tied with it stays)."""
    return logits.masked_fill(logits < floor[:, None], float("-inf"))


def top_logprobs(logits: torch.Tensor, k: int) -> dict[int, float]:
    """The k most likely tokens of one row of logits with their log-probabilities."""
    values, ids = logits.log_softmax(dim=-1).topk(k)
    return dict(zip(ids.tolist(), values.tolist()))
