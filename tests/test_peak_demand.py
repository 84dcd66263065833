"""The peak of the expected KV demand (pdserve/engine/peak_demand.py): small cases worked
out by hand, block size 4."""

from __future__ import annotations

import pytest

from pdserve.engine.length_estimator import OutputLengthEstimator
from pdserve.engine.output import HeldRequest
from pdserve.engine.peak_demand import PeakDemand, peak_demand


def held(tokens, generated, max_tokens):
    return HeldRequest("", tokens, generated, max_tokens)


def observed(*lengths):
    est = OutputLengthEstimator()
    for n in lengths:
        est.observe(n)
    return est


def test_requests_that_end_before_others_grow_are_not_counted_at_their_end():
    # every request generates 16 tokens; one is 12 in (20 tokens held), one starts (8)
    est = observed(*[16] * 5)
    reqs = [held(20, 12, 64), held(8, 0, 64)]
    # kv-aware's sum: blocks(20 + 4) + blocks(8 + 16) = 6 + 6 = 12. The peak, first reached
    # 1 step on: the first holds blocks(21) = 6 and the second blocks(9) = 3 until the first
    # ends after 3 more; the second alone never holds more than 6
    assert peak_demand(reqs, [0, 0], est, 4) == PeakDemand(9.0, 0.0, 1, 18 + 18)


def test_without_observations_each_request_runs_to_its_cap():
    reqs = [held(8, 0, 8), held(4, 0, 16)]
    # from 5 steps on: blocks(13) + blocks(9) = 4 + 3 until the first ends at its cap of 8;
    # then only the second (at most blocks(19) = 5)
    assert peak_demand(reqs, [0, 0], OutputLengthEstimator(), 4) == PeakDemand(7.0, 0.0, 5, 9)


def test_no_request_outlives_its_cap():
    est = observed(100, 100)
    # 10 tokens at most: 9 steps on it holds 17 tokens (5 blocks), then it is done
    assert peak_demand([held(8, 0, 10)], [0], est, 4) == PeakDemand(5.0, 0.0, 9, 5)


def test_a_request_older_than_every_observation_runs_to_its_cap():
    est = observed(4, 4)
    # 10 generated, longer than anything seen: alive until its cap of 12 (2 more steps),
    # holding blocks(18) and blocks(19) = 5: the peak is now
    assert peak_demand([held(18, 10, 12)], [0], est, 4) == PeakDemand(5.0, 0.0, 0, 5)
    # a cap far off: it grows to blocks(18 + 89) = 27 before its cap of 100
    assert peak_demand([held(18, 10, 100)], [0], est, 4).blocks == 27


def test_blocks_an_earlier_request_lists_count_once():
    est = observed(*[16] * 5)
    reqs = [held(8, 0, 64), held(8, 0, 64)]
    # both hold blocks(8 + 15) = 6 just before they end; the second's first 2 are shared
    assert peak_demand(reqs, [0, 2], est, 4).blocks == 6 + 4


def test_the_spread_at_the_peak():
    est = observed(8, 40)
    reqs = [held(8, 0, 64)] * 4
    peak = peak_demand(reqs, [0] * 4, est, 4)
    # 38 steps on: alive with probability 1/2 holding 12 blocks each
    assert peak.blocks == 24.0 and peak.horizon == 38
    assert peak.sd_blocks == pytest.approx(12.0)


def test_identical_requests_sum_to_whole_blocks():
    # 1 in 10 outputs runs to 100 tokens: ten alike requests are each alive 99 steps on
    # with probability 0.1, holding blocks(103) = 26: 26 blocks, where a float sum of ten
    # 2.6s reads 26.000000000000004 (and its ceiling 27 would refuse a block that is free)
    est = observed(*[1] * 9, 100)
    peak = peak_demand([held(4, 0, 200)] * 10, [0] * 10, est, 4)
    assert peak.blocks == 26.0 and peak.horizon == 99


def test_nothing_held():
    assert peak_demand([], [], observed(5), 4) == PeakDemand(0.0, 0.0, 0, 0)
