"""Output-length estimator and admission policies: exact expectations on small pools."""

from __future__ import annotations

import pytest

from decode.admission import ADMISSION, GreedyAdmission, KVAwareAdmission
from decode.length_estimator import OutputLengthEstimator
from pdserve.engine.output import HeldRequest
from pdserve.kv import BlockAllocator


class Pool:
    """The engine core's pool view (decode.admission.PoolView) over a bare allocator."""

    def __init__(self, alloc: BlockAllocator) -> None:
        self.alloc = alloc
        self.num_blocks = alloc.num_blocks

    @property
    def free_blocks(self) -> int:
        return self.alloc.num_free_blocks

    def blocks_needed(self, n: int) -> int:
        return self.alloc.blocks_needed(n)

    def can_reserve(self, token_ids) -> bool:
        return self.alloc.can_allocate(token_ids)

    def shared_blocks(self, token_ids) -> list[int]:
        return self.alloc.match_prefix(token_ids)


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
        ValueError, match="admission: unknown 'lucky'; choose one of greedy, kv-aware"
    ):
        ADMISSION["lucky"]


def test_kv_aware_counts_a_shared_prefix_block_once():
    alloc = BlockAllocator(20, 4)  # prefix caching on
    est = OutputLengthEstimator()
    for _ in range(10):
        est.observe(16)
    adm = kv_aware(alloc, est, margin=0.1)  # budget: 18 blocks
    # requests of 8 tokens + 16 expected: 6 blocks each
    assert adm.projected_blocks([Held(8, 0, 64, (0, 1)), Held(8, 0, 64, (0, 2))]) == 11
    assert adm.projected_blocks([Held(8, 0, 64, (0, 1)), Held(8, 0, 64, (3, 4))]) == 12
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
