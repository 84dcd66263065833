"""Sweep arithmetic: the busy-window throughput and the knee analysis."""

from __future__ import annotations

from pdserve.bench.serve import Sample
from pdserve.bench.sweep import analyze, steady_throughput


def sample(sent, first, end, tokens):
    return Sample(0, tokens, sent_at=sent, first_at=first, end_at=end)


def test_steady_throughput_counts_only_the_busy_window():
    # two clients: a 11-token request 0-10 s; a 21-token request 0-20 s (1 token/s each)
    # busy window: until the first request that ends after the last send (t=0) -> 10 s
    rate, window = steady_throughput([sample(0, 0, 10, 11), sample(0, 0, 20, 21)])
    assert window == 10
    assert rate == (11 + (1 + 20 * 0.5)) / 10
    # a third request sent at 10 s by the first client: the window runs to 20 s
    rate, window = steady_throughput(
        [sample(0, 0, 10, 11), sample(0, 0, 20, 21), sample(10, 10, 30, 21)]
    )
    assert window == 20 and rate == (11 + 21 + (1 + 20 * 0.5)) / 20


def test_analyze_finds_the_knee_and_the_fall_past_it():
    points = [
        {
            "policy": "p",
            "concurrency": c,
            "throughput_tok_s": t,
            "generated_tokens": 100,
            "recomputed_tokens": r,
        }
        for c, t, r in ((1, 10.0, 0), (2, 20.0, 0), (4, 12.0, 30), (8, 8.0, 70))
    ]
    a = analyze(points)["p"]
    assert a["knee_concurrency"] == 2 and a["peak_tok_s"] == 20.0
    assert a["worst_past_knee_fraction"] == 0.4
    assert a["recomputed_fraction"] == 100 / 400
