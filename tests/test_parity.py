"""bench parity's own books (pdserve/bench/parity.py); the benchmark itself launches a
cluster (docs/results/parity-smollm2.json)."""

from __future__ import annotations

import pytest

from pdserve.bench.parity import bench_parity, format_table, parity_prompts


def test_prompts_are_fixed_by_the_seed_and_differ_between_seeds():
    a, b = parity_prompts(4, 100, 1), parity_prompts(4, 100, 2)
    assert a == parity_prompts(4, 100, 1) and a != b
    assert all(24 <= len(p) <= 48 and all(3 <= t < 100 for t in p) for p in a)


@pytest.mark.parametrize(
    "kwargs", [{"rounds": 0}, {"max_tokens": 0}, {"concurrencies": (8, 0)}, {"threads": -1}]
)
def test_bad_arguments_fail_before_anything_is_loaded(kwargs):
    with pytest.raises(ValueError, match="must be >= 1"):
        bench_parity("no-such-model", **kwargs)


def test_the_table_shows_every_round_and_the_median():
    run = {"tok_s": {"engine": 100.0, "cluster": 80.0}, "ratio_cluster_over_engine": 0.8}
    report = {
        "model": "m",
        "max_tokens": 8,
        "threads": {"engine": 2},
        "points": [
            {
                "concurrency": 8,
                "engine_tok_s": [100.0, 110.0],
                "cluster_tok_s": [80.0, 77.0],
                "median_ratio": 0.75,
                "all_equal": True,
                "runs": [run, run],
            }
        ],
    }
    table = format_table(report)
    assert "100.0/110.0" in table and "80.0/77.0" in table and "0.75" in table
