"""Output-length estimator and admission policies: exact expectations on small pools."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine import length_estimator
from pdserve.engine.admission import (
    ADMISSION,
    CostAwareAdmission,
    GreedyAdmission,
    KVAwareAdmission,
    may_share,
)
from pdserve.engine.costs import PreemptionCosts
from pdserve.engine.length_estimator import OutputLengthEstimator
from pdserve.engine.output import HeldRequest
from pdserve.kv import BlockAllocator


class Pool:
    """The engine core's pool view (pdserve.engine.admission.PoolView) over a bare allocator."""

    def __init__(self, alloc: BlockAllocator, tiers=None, parks_victims=True) -> None:
        self.alloc = alloc
        self.num_blocks = alloc.num_blocks
        self.block_size = alloc.block_size
        self.tiers = tiers or {}  # name -> TierStats-like dict (OffloadStats.tiers)
        self.parks_victims = parks_victims and bool(self.tiers)
        self.stall = 0  # steps the longest-waiting preempted request has waited (a gauge)
        self.waiting = False  # whether a preempted request waits for room

    def longest_preempted_wait(self) -> int:
        return self.stall

    def preempted_waiting(self) -> bool:
        return self.waiting

    def tier_stats(self) -> dict[str, dict]:
        return self.tiers

    @property
    def free_blocks(self) -> int:
        return self.alloc.num_free_blocks

    def blocks_needed(self, n: int) -> int:
        return self.alloc.blocks_needed(n)

    def can_reserve(self, token_ids) -> bool:
        return self.alloc.can_allocate(token_ids)

    def shared_blocks(self, token_ids) -> list[int]:
        return self.alloc.match_prefix(token_ids)

    @property
    def num_shared_blocks(self) -> int:
        return self.alloc.num_shared


def Held(tokens, generated, max_tokens, block_ids=()):  # noqa: N802 - reads as the old record
    return HeldRequest("r", tokens, generated, max_tokens, tuple(block_ids))


def greedy(alloc, est=None):
    return GreedyAdmission(Pool(alloc), est or OutputLengthEstimator(), 0.05)


def kv_aware(alloc, est, margin):
    return KVAwareAdmission(Pool(alloc), est, margin)


def test_estimator_conditions_on_tokens_generated_and_caps_at_max_tokens():
    est = OutputLengthEstimator()
    assert est.remaining(0, 100) == 100  # nothing observed: assume the cap
    for n in (10, 20, 30, 200):
        est.observe(n)
    assert est.remaining(0, 1000) == (10 + 20 + 30 + 200) / 4
    assert est.remaining(0, 50) == (10 + 20 + 30 + 50) / 4  # capped by this request's limit
    assert est.remaining(15, 1000) == (20 + 30 + 200) / 3 - 15  # outlived 10 already
    assert est.remaining(25, 1000) == (30 + 200) / 2 - 25
    assert est.remaining(250, 300) == 50  # outlived everything seen: assume the cap
    assert est.remaining(300, 300) == 0


def test_estimator_moments_are_the_conditioned_capped_tail_exactly():
    """Against the definition computed directly (numpy over the capped tail): the same mean
    to the last bit, the variance to rounding."""
    rng = np.random.default_rng(7)
    est = OutputLengthEstimator(window=300)
    for n in rng.integers(1, 5000, size=700):  # the window keeps the last 300
        est.observe(int(n))
    lengths = np.array(list(est._recent))
    for g, m in [(0, 10_000), (0, 100), (17, 4000), (2500, 2600), (4999, 6000), (300, 200)]:
        tail = lengths[lengths > g]
        mean, var = est.moments(g, m)
        if tail.size == 0:
            assert (mean, var) == (max(0, m - g), 0.0)
            continue
        capped = np.minimum(tail, m)
        assert mean == float(capped.mean()) - g
        assert var == pytest.approx(float(capped.var()), rel=1e-12, abs=1e-9)
    assert est.mean_length() == float(lengths.mean())


def test_unshared_pools_skip_the_shared_block_sets_and_count_the_same():
    """With no block of two owners, owners' tables are disjoint: the count needs no sets,
    and a candidate's prefix hits still count once."""
    alloc = BlockAllocator(40, 4)  # prefix caching on
    est = OutputLengthEstimator()
    for _ in range(10):
        est.observe(16)
    adm = kv_aware(alloc, est, margin=0.1)
    a = alloc.allocate(list(range(8))).block_ids
    alloc.commit(a, list(range(8)), 8)
    c = alloc.allocate(list(range(50, 62))).block_ids
    held = [Held(8, 0, 64, a), Held(12, 0, 64, c)]
    assert alloc.num_shared == 0 and not may_share(adm.pool, held)
    assert adm.projected_blocks(held) == 6 + 7
    candidate = adm._new(list(range(8)) + [99], 64)  # hits a's two cached blocks
    assert candidate.block_ids == tuple(a) and may_share(adm.pool, [*held, candidate])
    assert adm.projected_blocks([*held, candidate]) == 6 + 7 + 7 - 2
    b = alloc.allocate(list(range(8)) + [99]).block_ids  # admitted: a's blocks have 2 owners
    assert alloc.num_shared == 2 and may_share(adm.pool, held)
    assert adm.projected_blocks([*held, Held(9, 0, 64, b)]) == 6 + 7 + 7 - 2
    for blocks in (a, b, c):
        alloc.free(blocks)
    alloc.check_integrity()
    assert alloc.num_shared == 0


def test_estimator_window_forgets_old_lengths():
    est = OutputLengthEstimator(window=2)
    for n in (1000, 10, 20):
        est.observe(n)
    assert est.count == 2 and est.remaining(0, 5000) == 15


def test_greedy_admits_while_blocks_are_free_now():
    alloc = BlockAllocator(10, 4, enable_prefix_caching=False)
    adm = greedy(alloc)
    held = [Held(4, 0, 1000)] * 5  # would need far more than 10 blocks later
    assert adm.check([1] * 8, 1000, held) is None
    assert adm.cost([1] * 8, 1000) == 2  # the prompt's blocks: greedy's headroom is free blocks
    alloc.allocate([1] * 36)  # 9 of 10 blocks now in use
    assert "2 KV blocks needed, 1 free" in adm.check([1] * 8, 10, [])


def test_no_policy_lets_anyone_ahead_of_a_preempted_request():
    alloc = BlockAllocator(10, 4, enable_prefix_caching=False)
    for adm in (
        greedy(alloc),
        kv_aware(alloc, sixteen(), 0.0),
        cost_aware(alloc, sixteen(), {"host": tier(100)}, step_s=0.05),
    ):
        adm.pool.waiting = True  # room for the prompt, but a preempted request waits
        assert adm.check([1] * 4, 16, []) == (
            "a preempted request is waiting for room (first come, first served)"
        )
        adm.pool.waiting = False
        assert adm.check([1] * 4, 16, []) is None
    adm.pool.waiting, adm.pool.stall = True, 7  # cost-aware offers the router no room either
    assert adm.headroom([]) == 0
    assert adm.inputs.longest_stall_steps == 7  # and its gauges still tell why
    adm.pool.waiting = False
    assert adm.headroom([]) > 0


def test_kv_aware_counts_expected_growth_of_everyone_held():
    alloc = BlockAllocator(20, 4, enable_prefix_caching=False)
    est = OutputLengthEstimator()
    for _ in range(10):
        est.observe(16)  # requests tend to generate 16 tokens
    adm = kv_aware(alloc, est, margin=0.1)  # budget: 18 blocks
    # each held request: 8 tokens now + 16 expected = 24 tokens = 6 blocks
    two = [Held(8, 0, 64), Held(8, 0, 64)]
    assert adm.projected_blocks(two) == 12
    # a new 8-token prompt: 12 + 6 = 18 <= 18
    assert adm.check([1] * 8, 64, two) is None
    # a third held request: 24 > 18
    reason = adm.check([1] * 8, 64, [*two, Held(8, 0, 64)])
    assert reason == "projected KV demand 24 blocks exceeds 18 (kv-aware admission)"
    # requests past the typical length are expected to run to their cap
    assert adm.projected_blocks([Held(40, 32, 64)]) == 18  # 40 + (64 - 32) = 72 tokens
    # what the router routes on: budget minus projected demand (free blocks under greedy)
    assert adm.headroom(two) == 18 - 12
    assert greedy(alloc, est).headroom(two) == 20
    # ...and what one admitted request takes of it, in the same unit: its projected blocks
    assert adm.cost([1] * 8, 64) == 6
    assert adm.headroom([*two, Held(8, 0, 64)]) == adm.headroom(two) - adm.cost([1] * 8, 64)


def test_unknown_policy_names_the_choices():
    with pytest.raises(
        ValueError, match="admission: unknown 'lucky'; choose one of greedy, kv-aware, cost-aware"
    ):
        ADMISSION["lucky"]


def test_kv_aware_counts_a_shared_prefix_block_once():
    alloc = BlockAllocator(20, 4)  # prefix caching on
    est = OutputLengthEstimator()
    for _ in range(10):
        est.observe(16)
    adm = kv_aware(alloc, est, margin=0.1)  # budget: 18 blocks
    # requests of 8 tokens + 16 expected: 6 blocks each; b shares a's first block
    a = alloc.allocate(list(range(100, 108))).block_ids
    b = [*alloc.fork(a[:1]), *alloc.allocate_fresh(1).block_ids]
    c = alloc.allocate(list(range(200, 208))).block_ids
    assert adm.projected_blocks([Held(8, 0, 64, a), Held(8, 0, 64, b)]) == 11
    assert adm.projected_blocks([Held(8, 0, 64, a), Held(8, 0, 64, c)]) == 12
    alloc.free(a)
    alloc.free(b)
    alloc.free(c)
    # a holds the two cached blocks of tokens 0..7; c holds two other blocks
    blocks = alloc.allocate(list(range(8))).block_ids
    alloc.commit(blocks, list(range(8)), 8)
    held = [Held(8, 0, 64, tuple(blocks)), Held(8, 0, 64, (5, 6))]  # 12 blocks projected
    # a 9-token prompt (9 + 16 tokens: 7 blocks) sharing a's two blocks: 12 + 7 - 2 = 17
    shared = list(range(8)) + [99]
    assert alloc.match_prefix(shared) == blocks
    assert adm.check(shared, 64, held) is None
    assert adm.cost(shared, 64) == 7 - 2  # the two shared blocks are counted already
    # the same length sharing nothing: 12 + 7 = 19 > 18
    other = list(range(50, 59))
    assert adm.check(other, 64, held) == (
        "projected KV demand 19 blocks exceeds 18 (kv-aware admission)"
    )


def test_estimator_moments_are_those_of_the_conditional_lengths():
    est = OutputLengthEstimator()
    assert est.moments(0, 100) == (100, 0.0)  # nothing observed: the cap, no spread
    for n in (10, 20, 30, 200):
        est.observe(n)
    mean, var = est.moments(15, 1000)  # outlived 10: 20, 30, 200 remain possible
    assert mean == pytest.approx((20 + 30 + 200) / 3 - 15)
    assert var == pytest.approx(((5 - mean) ** 2 + (15 - mean) ** 2 + (185 - mean) ** 2) / 3)
    # capped at 40: 20, 30, 40 -> remaining 15 +- a variance of (100 + 0 + 100) / 3
    assert est.moments(15, 40) == pytest.approx((15, 200 / 3))
    assert est.mean_length() == 65.0
    # answers are remembered until the next observation, then computed afresh
    est.observe(40)
    assert est.moments(15, 40) == pytest.approx((17.5, 68.75))  # 20, 30, 40, 40 -> 5 .. 25
    assert est.mean_length() == 60.0
    for g in range(length_estimator.MEMO_MAX + 50):  # a long run with nothing finishing
        est.moments(g, 10**6)
    assert len(est._memo) <= length_estimator.MEMO_MAX
    assert est.moments(15, 40) == pytest.approx((17.5, 68.75))


def tier(capacity, used=0, moved_blocks=0, spill_s=0.0, reload_s=0.0, block_bytes=1000):
    """One tier's stats: `moved_blocks` spilled and reloaded in spill_s / reload_s."""
    return {
        "capacity": capacity,
        "used_blocks": used,
        "block_bytes": block_bytes,
        "spilled_bytes": moved_blocks * block_bytes,
        "reloaded_bytes": moved_blocks * block_bytes,
        "spill_s": spill_s,
        "reload_s": reload_s,
    }


def cost_aware(alloc, est, tiers=None, parks=True, step_s=None, recompute_s=None, margin=0.1):
    costs = PreemptionCosts()
    costs.step_s, costs.recompute_s_per_token = step_s, recompute_s
    return CostAwareAdmission(Pool(alloc, tiers, parks), est, margin, costs)


def sixteen():
    est = OutputLengthEstimator()
    for _ in range(10):
        est.observe(16)  # every request generates 16 tokens: no spread
    return est


def test_cost_aware_is_kv_aware_where_nothing_can_be_parked():
    alloc = BlockAllocator(20, 4, enable_prefix_caching=False)
    three = [Held(8, 0, 64)] * 3  # 6 blocks each projected, budget 18
    for adm in (
        cost_aware(alloc, sixteen()),  # no tiers
        cost_aware(alloc, sixteen(), {"host": tier(100)}, parks=False),  # recompute preemption
        cost_aware(alloc, sixteen(), {"host": tier(100, used=100)}),  # the tier is full
    ):
        assert adm.check([1] * 8, 64, three[:2]) is None  # 18 <= 18
        assert adm.check([1] * 8, 64, three) == (
            "projected KV demand 24 blocks exceeds 18 (cost-aware admission)"
        )
        assert adm.inputs.overcommit_blocks == 0
        assert adm.headroom(three[:2]) == kv_aware(alloc, sixteen(), 0.1).headroom(three[:2])


def test_cost_aware_admits_no_further_than_the_expected_peak_however_cheap_parking_is():
    alloc = BlockAllocator(20, 4, enable_prefix_caching=False)
    # 10 blocks moved out in 0.01 s and back in 0.01 s: 2 ms per block both ways; a step
    # takes 50 ms; requests live 16 steps: the tier's 100 blocks fit the parking budget
    # (0.05 * 16 * 0.05 / 0.002 = 20 blocks), but with no spread there is nothing to park:
    # the limit is the pool's budget, 18 (until 2026-12-07 it was 18 + 20)
    tiers = {"host": tier(100, moved_blocks=10, spill_s=0.01, reload_s=0.01)}
    adm = cost_aware(alloc, sixteen(), tiers, step_s=0.05)
    held = [Held(8, 0, 64)] * 6  # 6 projected blocks each
    assert adm.check([1] * 8, 64, held[:2]) is None  # 18 <= 18
    assert adm.check([1] * 4, 64, held[:2]) is None  # 12 + 5 <= 18
    assert adm.check([1] * 8, 64, held[:3]) == (
        "projected KV demand 24 blocks exceeds 18 (cost-aware admission)"
    )
    assert adm.inputs.overcommit_blocks == 0 and adm.inputs.park_s_per_block == {
        "host": pytest.approx(0.002)
    }
    assert adm.headroom(held) == 18 - 36
    # a small tier not measured yet (the old rule: 18 + 7), or a full one: the same limit
    for small in ({"host": tier(7)}, {"host": tier(100, used=100)}):
        assert cost_aware(alloc, sixteen(), small, step_s=0.05).headroom(held) == 18 - 36


def test_cost_aware_admits_past_the_peak_by_what_the_tiers_hold_only_with_no_line():
    alloc = BlockAllocator(20, 4, enable_prefix_caching=False)
    tiers = {"host": tier(100, moved_blocks=10, spill_s=0.01, reload_s=0.01)}
    adm = cost_aware(alloc, sixteen(), tiers, step_s=0.05)
    held = [Held(8, 0, 64)] * 3  # 6 projected blocks each, 18 with the newcomer's: 24
    refused = "projected KV demand 24 blocks exceeds 18 (cost-aware admission)"
    # a line waits (more than one request per decode worker), or it is not known: the peak
    for waiting in (None, 1.5, 4.0):
        assert adm.check([1] * 8, 64, held, waiting) == refused
        assert adm.inputs.overcommit_blocks == 0
    # at most one waiting per worker: past the peak by the 20 blocks the parking budget
    # holds in the tier (no spread to keep), as the rule before 2026-12-07
    for waiting in (1.0, 0.5):
        assert adm.check([1] * 8, 64, held, waiting) is None
        assert adm.inputs.overcommit_blocks == 20
    assert adm.check([1] * 8, 64, [Held(8, 0, 64)] * 6, 1.0) == (
        "projected KV demand 42 blocks exceeds 38 (cost-aware admission)"
    )
    # never where nothing can be parked (recompute preemption): the peak rule, line or not
    recompute = cost_aware(alloc, sixteen(), tiers, step_s=0.05, parks=False)
    assert recompute.check([1] * 8, 64, held, 1.0) == refused
    # greedy and kv-aware take the same argument and do not read it
    assert kv_aware(alloc, sixteen(), 0.1).check([1] * 8, 64, held, 1.0) == (
        "projected KV demand 24 blocks exceeds 18 (kv-aware admission)"
    )
    assert greedy(alloc).check([1] * 8, 64, held, 1.0) is None


def spread():
    est = OutputLengthEstimator()
    for n in (8, 40):
        est.observe(n)  # half the requests end after 8 tokens, half after 40
    return est


def test_cost_aware_stops_at_a_tier_slower_than_recomputing():
    alloc = BlockAllocator(20, 4, enable_prefix_caching=False)
    held = [Held(8, 0, 64)] * 4  # expected peak 24 blocks, sd 12 (the test below)
    tiers = {
        "host": tier(5, moved_blocks=10, spill_s=0.001, reload_s=0.001),  # 0.2 ms per block
        "disk": tier(100, moved_blocks=10, spill_s=0.5, reload_s=0.5),  # 100 ms per block
    }
    # recomputing a 4-token block costs 4 * 5 ms = 20 ms: the disk tier does not count; the
    # host holds 5 of the 12 blocks of spread, the pool keeps 7
    adm = cost_aware(alloc, spread(), tiers, step_s=1.0, recompute_s=0.005)
    assert adm.headroom(held) == 18 - 7 - 24
    # recompute dearer than the disk: the host's 5 blocks (1 ms of the 1.2 s parking budget,
    # 0.05 * 24 steps * 1 s), then the disk's blocks while the rest lasts: 11.99 blocks, so
    # the tiers hold the whole spread and the pool keeps none of it
    adm = cost_aware(alloc, spread(), tiers, step_s=1.0, recompute_s=1.0)
    assert adm.headroom(held) == 18 - 24
    assert adm.inputs.overcommit_blocks == 0


def test_a_worker_holding_nothing_admits_whatever_fits():
    # one request alone: 15 of 100 observed outputs end at 100 tokens, 85 run to 14,000;
    # its prompt plus cap (944 blocks of 16) fits the 950-block budget, but its expected
    # peak (750 blocks) plus one standard deviation of it (alive with probability 0.85)
    # would not: an empty worker must not refuse it for its spread, or it waits forever
    alloc = BlockAllocator(1000, 16, enable_prefix_caching=False)
    est = OutputLengthEstimator()
    for n in [100] * 15 + [14_000] * 85:
        est.observe(n)
    for adm in (
        cost_aware(alloc, est, margin=0.05),  # recompute: no tiers
        cost_aware(alloc, est, {"host": tier(10)}, margin=0.05),
        kv_aware(alloc, est, 0.05),
    ):
        assert adm.check([1] * 100, 15_000, []) is None
    # with one request held the same newcomer counts: the tail is kept inside the pool, but
    # never more of it than both at their caps would hold (here less than the tail)
    adm = cost_aware(alloc, est, margin=0.05)
    small = [Held(16, 0, 16)]  # 2 blocks at its cap
    assert adm.check([1] * 100, 15_000, small) is None
    assert adm.inputs.overcommit_blocks == -(944 + 2 - adm.inputs.demand_blocks)


def test_cost_aware_keeps_the_tail_of_the_demand_in_the_tiers():
    alloc = BlockAllocator(20, 4, enable_prefix_caching=False)
    held = [Held(8, 0, 64)] * 4
    adm = cost_aware(alloc, spread(), {"host": tier(10)}, step_s=0.05)
    adm.headroom(held)
    # the demand peaks 38 steps on: each request alive with probability 1/2, holding 12
    # blocks (46 tokens): 4 * 6 = 24 blocks, variance 4 * 144 / 4 = 144, sd 12 blocks
    assert adm.inputs.demand_blocks == 24
    assert adm.inputs.demand_sd_blocks == 12.0
    # the tail (1 sd) is more than the tier holds: 2 blocks of the pool are kept for it
    assert adm.inputs.overcommit_blocks == 10 - 12
    assert adm.headroom(held) == 18 - 2 - 24
    # a tier that holds more than the tail keeps none of it in the pool, and lets nothing
    # in past the expected peak either
    adm = cost_aware(alloc, spread(), {"host": tier(30)}, step_s=0.05)
    assert adm.headroom(held) == 18 - 24
    assert adm.inputs.overcommit_blocks == 0


def test_cost_aware_rotates_parked_requests_by_what_a_round_trip_costs():
    alloc = BlockAllocator(20, 4, enable_prefix_caching=False)
    # 10 blocks moved both ways in 0.02 + 0.03 s: 5 ms a block; a decode step of 50 ms,
    # of which parking may take 5%: 2.5 ms a step, so a block's round trip is paid for by
    # two steps of running
    moved = tier(100, moved_blocks=10, spill_s=0.02, reload_s=0.03)
    adm = cost_aware(alloc, sixteen(), {"host": moved}, step_s=0.05)
    assert adm.rotation() is not None
    assert adm.rotation()() == pytest.approx(2.0)
    adm.headroom([])
    assert adm.inputs.rotation_steps_per_block == pytest.approx(2.0)
    # a full tier is passed over for the next one parks go to
    adm = cost_aware(alloc, sixteen(), {"host": tier(10, used=10), "disk": moved}, step_s=0.05)
    assert adm.rotation_steps_per_block() == pytest.approx(2.0)
    # not measured yet: one step
    assert cost_aware(alloc, sixteen(), {"host": tier(100)}, step_s=0.05).rotation()() == 0.0
    assert cost_aware(alloc, sixteen(), {"host": moved}).rotation()() == 0.0
    # nothing to park into, or recompute preemption: no rotation; nor for the other policies
    assert cost_aware(alloc, sixteen()).rotation() is None
    assert cost_aware(alloc, sixteen(), {"host": moved}, parks=False).rotation() is None
    assert greedy(alloc).rotation() is None
    assert kv_aware(alloc, sixteen(), 0.1).rotation() is None


def test_preemption_costs_learn_from_steps():
    costs = PreemptionCosts()
    costs.observe_step(0.1, decode_seqs=4, prefill_tokens=0)
    assert costs.step_s == 0.1 and costs.recompute_s_per_token is None
    costs.observe_step(0.2, decode_seqs=4, prefill_tokens=0)
    assert costs.step_s == pytest.approx(0.11)  # EWMA, alpha 0.1
    costs.observe_step(0.31, decode_seqs=4, prefill_tokens=100)  # 0.2 s more for 100 tokens
    assert costs.recompute_s_per_token == pytest.approx(0.002)
    assert costs.step_s == pytest.approx(0.11)  # a mixed step is not a decode step
    assert PreemptionCosts.park_s_per_block(tier(1, moved_blocks=0)) is None
    assert PreemptionCosts.park_s_per_block(
        tier(1, moved_blocks=4, spill_s=0.004, reload_s=0.002)
    ) == pytest.approx(0.0015)


def test_recompute_cost_weighs_each_prompt_token_the_same():
    """A memory-bound step carries a short prompt for nothing; a long context computed again
    costs its tokens. Twenty free 50-token chunks beside one 2,048-token chunk that added
    0.2 s: the cost per token is their time over their tokens (a mean over steps would read
    it ~5x lower), a chunk seen 16,384 prompt tokens ago weighing half."""
    costs = PreemptionCosts()
    costs.observe_step(0.1, decode_seqs=40, prefill_tokens=0)
    costs.observe_step(0.3, decode_seqs=40, prefill_tokens=2048)
    for _ in range(20):
        costs.observe_step(0.1, decode_seqs=40, prefill_tokens=50)
    f = 0.5 ** (50 / 16384)  # each 50-token chunk fades what came before by this
    tokens = 2048 * f**20 + 50 * sum(f**k for k in range(20))
    assert costs.recompute_s_per_token == pytest.approx(0.2 * f**20 / tokens)
    # 2048 tokens cost 0.2 s (9.8e-5 each), diluted by the free ones' 1,000 tokens: 6.5e-5;
    # an exponential mean over steps (alpha 0.1) would have read 9.8e-5 * 0.9**20 = 1.2e-5
    assert 6e-5 < costs.recompute_s_per_token < 7e-5
    old = PreemptionCosts()  # 16,384 tokens later the 2,048-token chunk weighs half
    old.observe_step(0.1, decode_seqs=40, prefill_tokens=0)
    old.observe_step(0.3, decode_seqs=40, prefill_tokens=2048)
    old.observe_step(0.1, decode_seqs=40, prefill_tokens=16384)
    assert old.recompute_s_per_token == pytest.approx(0.1 / (1024 + 16384))


def test_a_moved_request_is_judged_from_its_start():
    """A migration's Reserve says how much the request generated before (its context ends
    with it): admission conditions its expected remaining length on that, not on a fresh
    start under what it has left. Every observed request generated 12 tokens: a new request
    capped at 16 is expected to add 12 to its 40-token context (52: 4 blocks of 16), one
    that generated 10 before only 2 more (42: 3 blocks)."""
    est = OutputLengthEstimator()
    for _ in range(20):
        est.observe(12)
    policy = kv_aware(BlockAllocator(59, 16), est, 0.0)  # a budget of 59 blocks
    context = list(range(1, 41))
    assert policy.cost(context, 16) == 4
    assert policy.cost(context, 16, generated=10) == 3
    held = [Held(40, 0, 16)] * 14  # 14 x 4 = 56 blocks expected of 59
    assert policy.check(context, 16, held, generated=10) is None  # 56 + 3 fits
    assert policy.check(context, 16, held) is not None  # 56 + 4 does not
