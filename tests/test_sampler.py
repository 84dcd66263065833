"""The batched inverse-CDF sampler (pdserve/engine/sampler.py): the draws follow the
filtered distribution, the cheap paths (no filter, top-k, nucleus within the first
candidates) agree with a full sort, and a flat distribution falls back to the sort."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import NUCLEUS_FIRST, NonFiniteLogits, _filtered, sample
from pdserve.sampling_params import SamplingParams


def _by_position(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The filtered distribution by its textbook definition: sort each row, keep its first k,
    then the smallest prefix whose mass reaches p, renormalise, scatter back."""
    out = torch.zeros_like(logits)
    for i, row in enumerate(logits):
        values, ids = row.sort(descending=True)
        k = top_k[i] if 0 < top_k[i] < row.numel() else row.numel()
        probs = values[:k].softmax(dim=0)
        before = probs.cumsum(dim=0) - probs
        probs = probs[before < top_p[i]]
        out[i, ids[: probs.numel()]] = probs / probs.sum()
    return out


def test_draws_follow_the_filtered_distribution():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05]] * 3))
    cases = [  # (params, expected probabilities)
        (SamplingParams(temperature=1.0), [0.4, 0.3, 0.2, 0.05, 0.05]),
        (SamplingParams(temperature=1.0, top_k=2), [4 / 7, 3 / 7, 0, 0, 0]),
        (SamplingParams(temperature=1.0, top_p=0.8), [4 / 9, 3 / 9, 2 / 9, 0, 0]),
    ]
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.zeros(3, 5)
    params = [p for p, _ in cases]
    for _ in range(n):
        for row, token in enumerate(sample(logits, params, [None] * 3, gen)):
            counts[row, token] += 1
    expected = torch.tensor([e for _, e in cases])
    # 4 sigma of a binomial proportion at n = 20,000 is at most 0.0142
    assert ((counts / n - expected).abs() <= 0.0142).all(), counts / n
    assert (counts[expected == 0] == 0).all()  # a filtered token is never drawn


def test_the_filter_is_the_textbook_distribution_on_every_path():
    gen = torch.Generator().manual_seed(1)
    vocab = 5000
    peaked = torch.randn(4, vocab, generator=gen) * 4  # nucleus inside the first candidates
    flat = torch.randn(4, vocab, generator=gen) * 0.1  # nucleus wider: the full sort
    top_k = [vocab, 40, vocab, 3000]
    top_p = [0.9, 1.0, 0.5, 0.95]
    for logits in (peaked, flat):
        expected = _by_position(logits, top_k, top_p)
        torch.testing.assert_close(_filtered(logits, top_k, top_p), expected)


def test_ties_at_the_cut_are_all_kept():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    probs = _filtered(logits, [2], [1.0])  # the 2nd largest logit is 2.0, held by two tokens
    assert (probs[0] > 0).tolist() == [True, False, True, True, False]
    probs = _filtered(logits, [5], [0.7])  # the mass reaches 0.7 inside the tied pair
    assert (probs[0] > 0).tolist() == [True, False, True, True, False]


def _draws(logits, params, seeded_row: int, steps: int = 30) -> list[int]:
    """The tokens of `seeded_row` (seed 7) over `steps` calls with these rows batched."""
    gens = [
        torch.Generator().manual_seed(7) if i == seeded_row else None for i in range(len(params))
    ]
    engine = torch.Generator().manual_seed(123)
    return [sample(logits, params, gens, engine)[seeded_row] for _ in range(steps)]


def test_seeded_rows_draw_the_same_tokens_whatever_else_is_batched():
    """A seeded row (plain, top-k, top-p) alone and batched with rows that send the step
    down every path: a plain softmax, topk candidates, a full sort (a flat row whose nucleus
    is wider than the first candidates), greedy. Logits rounded to bf16 (ties, as a bf16
    model's are) over a vocabulary wider than NUCLEUS_FIRST."""
    gen = torch.Generator().manual_seed(2)
    vocab = 3 * NUCLEUS_FIRST
    peaked = (torch.randn(vocab, generator=gen) * 3).bfloat16().float()
    flat = (torch.randn(vocab, generator=gen) * 0.05).bfloat16().float()
    seeded = [
        SamplingParams(temperature=0.9, seed=7),
        SamplingParams(temperature=0.9, top_k=50, seed=7),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7),
    ]
    others = [
        (flat, SamplingParams(temperature=1.0, top_p=0.95)),  # forces the full sort
        (peaked, SamplingParams(temperature=1.0)),  # plain
        (peaked, SamplingParams(temperature=0.7, top_k=5)),  # topk
        (peaked, SamplingParams(temperature=0)),  # greedy
    ]
    for params in seeded:
        alone = _draws(peaked[None], [params], 0)
        assert len(set(alone)) > 1  # it samples, not argmax
        for other_logits, other in others:
            logits = torch.stack([other_logits, peaked])
            assert _draws(logits, [other, params], 1) == alone, (params, other)


def test_non_finite_logits_are_a_typed_error():
    logits = torch.tensor([[0.0, 1.0, float("nan")], [0.0, 1.0, 2.0]])
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5)):
        with pytest.raises(NonFiniteLogits, match="row 0"):
            sample(logits, [params, params], [None, None], torch.Generator())
    # a greedy row with a NaN elsewhere in the step is not drawn: no error
    ok = sample(logits[1:], [SamplingParams(temperature=1.0)], [None], torch.Generator())
    assert 0 <= ok[0] < 3
