"""Sweep arithmetic: the busy-window throughput and the knee analysis."""

from __future__ import annotations

import pytest

from pdserve.bench.serve import Sample
from pdserve.bench.slo import SLO, goodput, parse_slo
from pdserve.bench.sweep import analyze, apply_slo, steady_throughput, warm_throughput


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


def test_warm_throughput_starts_after_the_first_wave():
    # two clients, three requests each, 1 token/s; ends at 10, 20, 20, 30, 35, 40
    reqs = [
        sample(0, 0, 10, 11),  # client a
        sample(0, 0, 20, 21),  # client b
        sample(10, 10, 20, 11),  # a
        sample(20, 20, 30, 11),  # b
        sample(20, 20, 35, 16),  # a
        sample(30, 30, 40, 11),  # b, the last send (30 s)
    ]
    # busy window: until the first end after the last send (30 s) -> 35 s; the first wave
    # is over once 2 requests ended (at 20 s): 20-35 s
    rate, window = warm_throughput(reqs, 2)
    assert window == 15
    # in (20, 35]: none of the first three; the 4th all 10 tokens after its first (at 20),
    # the 5th its 15 after 20, the 6th 1 + 5 of its 10 evenly spread ones
    assert rate == (10 + 15 + 6) / 15
    for r in reqs:
        r.token_times = [r.first_at + i for i in range(r.output_tokens)]
    assert warm_throughput(reqs, 2) == (rate, 15)  # the same, counted by arrival times
    # nothing after the first wave
    assert warm_throughput(reqs[:2], 2) == (None, 0.0)
    # the first four: the window after the first wave (20-30 s) sees one request end, fewer
    # than the two clients: a moment, not a state
    assert warm_throughput(reqs[:4], 2) == (None, 0.0)


def test_analyze_finds_the_knee_and_the_fall_past_it():
    points = [
        {
            "policy": "p",
            "concurrency": c,
            "throughput_tok_s": t,
            "generated_tokens": 100,
            "recomputed_tokens": r,
            "tpot_p99_s": 0.1 * c,
        }
        for c, t, r in ((1, 10.0, 0), (2, 20.0, 0), (4, 12.0, 30), (8, 8.0, 70))
    ]
    a = analyze(points)["p"]
    assert a["knee_concurrency"] == 2 and a["peak_tok_s"] == 20.0
    assert a["worst_past_knee_fraction"] == 0.4
    assert a["recomputed_fraction"] == 100 / 400
    assert a["tpot_p99_vs_unloaded"] == {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}


def test_steady_throughput_counts_tokens_when_they_arrived():
    # the 21-token request got 1 token at 0 s and 20 tokens at 19-20 s (it was preempted):
    # inside the 10 s window it delivered 1 token, not the 11 an even spread would say
    slow = sample(0, 0, 20, 21)
    slow.token_times = [0.0] + [19.0 + i / 20 for i in range(20)]
    fast = sample(0, 0, 10, 11)
    fast.token_times = [float(i) for i in range(11)]
    rate, window = steady_throughput([fast, slow])
    assert window == 10 and rate == (11 + 1) / 10


def test_slo_parsing_goodput_and_relative_targets():
    assert parse_slo("ttft=2,tpot=0.05") == SLO(2.0, 0.05)
    assert parse_slo("tpot=0.2") == SLO(2.0, 0.2)
    rel = parse_slo("ttft=4x")
    assert rel == SLO(4.0, 2.0, relative=True) and rel.resolve(0.5, 0.1) == SLO(2.0, 0.2)
    for bad, message in (
        ("ttft=fast", "ttft: expected seconds"),
        ("ttft=-1", "positive finite"),
        ("tpot=inf", "positive finite"),
        ("ttft=2,tpot=3x", "must both be seconds or both multiples"),
        ("latency=2", "expected ttft=SECONDS"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_slo(bad)
    requests = [
        {"ttft_s": 1.0, "tpot_s": 0.1, "output_tokens": 10},
        {"ttft_s": 3.0, "tpot_s": 0.1, "output_tokens": 20},  # TTFT too long
        {"ttft_s": 1.0, "tpot_s": 0.3, "output_tokens": 30},  # TPOT too long
        {"ttft_s": 0.0, "tpot_s": 0.0, "output_tokens": 0, "error": "UNAVAILABLE"},
    ]
    assert goodput(requests, SLO(2.0, 0.2), 10.0) == (0.1, 1.0)
    assert goodput(requests, SLO(5.0, 0.5), 10.0) == (0.3, 6.0)


def test_a_relative_slo_is_resolved_against_the_unloaded_point():
    def point(policy, c, ttft, tpot):
        return {
            "policy": policy,
            "concurrency": c,
            "ttft_p50_s": ttft,
            "tpot_p50_s": tpot,
            "elapsed_s": 10.0,
            "requests": [{"ttft_s": ttft, "tpot_s": tpot, "output_tokens": 10}] * 5,
        }

    points = [point("a", 1, 0.2, 0.1), point("a", 8, 1.5, 0.15), point("b", 8, 0.5, 0.5)]
    used = apply_slo(points, parse_slo("ttft=5x,tpot=2x"))
    assert used["default"] == SLO(1.0, 0.2).to_dict()  # 5 x 0.2 s, 2 x 0.1 s
    assert [p["goodput_req_s"] for p in points] == [0.5, 0.0, 0.0]
    assert [p["goodput"]["loose"]["req_s"] for p in points] == [0.5, 0.5, 0.0]
    assert points[0]["goodput_tok_s"] == 5.0


def test_an_open_loop_window_ends_at_the_last_arrival():
    # arrivals at 0, 5 and 10 s; the last one decodes alone until 40 s: the window is the
    # 10 s in which requests were still arriving, tokens counted when they came
    reqs = [sample(0, 0, 10, 11), sample(5, 5, 15, 11), sample(10, 10, 40, 31)]
    for r in reqs:
        r.token_times = [r.first_at + i for i in range(r.output_tokens)]
    rate, window = steady_throughput(reqs, open_loop=True)
    assert window == 10
    assert rate == (11 + 6 + 1) / 10  # 0..10 s, 5..10 s, and the last one's first token
    # the closed-loop rule on the same records runs to the first end after the last send
    assert steady_throughput(reqs)[1] == 15 - 0


def test_analyze_and_the_slo_use_the_rate_on_open_loop_points():
    def point(rate, tok_s, tpot):
        return {
            "policy": "p",
            "concurrency": None,
            "rate": rate,
            "throughput_tok_s": tok_s,
            "generated_tokens": 10,
            "recomputed_tokens": 0,
            "ttft_p50_s": 1.0 / rate,
            "tpot_p50_s": tpot,
            "tpot_p99_s": tpot,
            "elapsed_s": 10.0,
            "requests": [{"ttft_s": 1.0, "tpot_s": tpot, "output_tokens": 10}],
        }

    points = [point(0.4, 9.0, 0.3), point(0.1, 3.0, 0.1), point(0.2, 6.0, 0.2)]
    a = analyze(points)["p"]
    assert a["knee_rate"] == 0.4 and a["knee_concurrency"] is None
    assert a["throughput_by_load"] == {0.1: 3.0, 0.2: 6.0, 0.4: 9.0}
    assert a["tpot_p99_vs_unloaded"] == {0.1: 1.0, 0.2: 2.0, 0.4: pytest.approx(3.0)}
    used = apply_slo(points, parse_slo("ttft=5x,tpot=2x"))
    # unloaded: the lowest rate's p50s (TTFT 10 s, TPOT 0.1 s) -> 50 s and 0.2 s
    assert used["unloaded_from"] == {"policy": "p", "concurrency": None, "rate": 0.1}
    assert used["default"]["ttft_s"] == 50.0 and used["default"]["tpot_s"] == 0.2
    assert [p["goodput_req_s"] for p in points] == [0.0, 0.1, 0.1]


def test_prefill_args_may_not_change_the_pool_the_report_names():
    from pdserve.bench.sweep import bench_sweep

    with pytest.raises(ValueError, match="--block-size is the sweep's own"):
        bench_sweep("tiny-llama", ["default"], [1], prefill_args=["--block-size", "32"])
    with pytest.raises(ValueError, match="--num-kv-blocks=8 is the sweep's own"):
        bench_sweep("tiny-llama", ["default"], [1], prefill_args=["--num-kv-blocks=8"])


def test_an_output_no_pool_can_hold_is_refused_before_anything_starts():
    from pdserve.bench.sweep import bench_sweep

    # long-prompt prompts reach 320 tokens; 32 blocks of 16 hold 512: up to 192 more fit
    with pytest.raises(ValueError, match=r"cannot hold one long-prompt prompt .*\(up to 193\)"):
        bench_sweep("tiny-llama", ["default"], [1], num_kv_blocks=32, workload="long-prompt",
                    max_output=193)  # fmt: skip
    with pytest.raises(ValueError, match="cannot hold"):
        bench_sweep("tiny-llama", ["default"], [1], num_kv_blocks=32, max_output=0)
