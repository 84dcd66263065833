"""The batched inverse-CDF sampler (pdserve/engine/sampler.py): the draws follow the
filtered distribution, the cheap paths (no filter, top-k, nucleus within the first
candidates) agree with a full sort, and a flat distribution falls back to the sort."""

from __future__ import annotations

import torch

from pdserve.engine.sampler import NUCLEUS_FIRST, _candidates, _filter_sorted, sample
from pdserve.sampling_params import SamplingParams


def _full_sort_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The filtered distribution over the vocabulary, by a full sort (the definition)."""
    values, ids = logits.sort(dim=-1, descending=True)
    k = torch.tensor([x if 0 < x < logits.shape[-1] else logits.shape[-1] for x in top_k])
    probs = _filter_sorted(values, k, torch.tensor(top_p))
    return torch.zeros_like(probs).scatter(1, ids, probs)


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


def test_candidates_give_the_full_sort_distribution():
    gen = torch.Generator().manual_seed(1)
    vocab = 5000
    peaked = torch.randn(4, vocab, generator=gen) * 4  # nucleus inside the first candidates
    flat = torch.randn(4, vocab, generator=gen) * 0.1  # nucleus wider: the full sort
    top_k = [0, 40, 0, 3000]
    top_p = [0.9, 1.0, 0.5, 0.95]
    for logits in (peaked, flat):
        probs, ids = _candidates(logits, [x or vocab for x in top_k], top_p)
        full = torch.zeros(4, vocab).scatter(1, ids, probs)
        torch.testing.assert_close(full, _full_sort_probs(logits, top_k, top_p))
    probs, _ = _candidates(peaked, [vocab] * 4, [0.9] * 4)
    assert probs.shape[-1] == NUCLEUS_FIRST  # no sort when the nucleus fits
    probs, _ = _candidates(flat, [vocab] * 4, [0.9] * 4)
    assert probs.shape[-1] == vocab


def test_seeded_rows_draw_the_same_tokens_whatever_else_is_batched():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2)) * 3
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    mine, others = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    alone = [sample(logits[1:2], [seeded], [mine], torch.Generator())[0] for _ in range(30)]
    params = [SamplingParams(temperature=1.0, top_k=5), seeded, SamplingParams(temperature=0)]
    engine = torch.Generator().manual_seed(123)
    batched = [sample(logits, params, [None, others, None], engine) for _ in range(30)]
    assert [b[1] for b in batched] == alone
    assert len(set(alone)) > 1  # it samples, not argmax
    assert all(b[2] == int(logits[2].argmax()) for b in batched)
