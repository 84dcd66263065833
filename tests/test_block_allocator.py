"""Block allocator: tiny pools, exact block ids, refcounts and eviction order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kv import BlockAllocator, NoFreeBlocks
from pdserve.kv.block_allocator import Evicted, chain_hash


def owners_of(tables: list[list[int]]) -> dict[int, int]:
    owners: dict[int, int] = {}
    for table in tables:
        for b in table:
            owners[b] = owners.get(b, 0) + 1
    return owners


def take(a: BlockAllocator, tokens: list[int]) -> tuple[list[int], int]:
    got = a.allocate(tokens)
    return got.block_ids, got.cached_tokens


def test_fresh_allocation_takes_lowest_free_blocks():
    a = BlockAllocator(num_blocks=6, block_size=4)
    blocks, cached = take(a, list(range(10)))
    assert (blocks, cached) == ([0, 1, 2], 0)
    assert a.ref_counts == [1, 1, 1, 0, 0, 0]
    assert a.num_free_blocks == 3
    a.check_integrity(owners_of([blocks]))


def test_prefix_hit_reuses_committed_full_blocks_only():
    a = BlockAllocator(num_blocks=6, block_size=4)
    tokens = list(range(10))
    blocks, _ = take(a, tokens)
    a.commit(blocks, tokens, num_computed=10)  # blocks 0 and 1 are full, block 2 is not
    assert a.block_hash[0] is not None and a.block_hash[1] is not None
    assert a.block_hash[2] is None
    again, cached = take(a, tokens)
    assert (again, cached) == ([0, 1, 3], 8)
    assert a.ref_counts[:4] == [2, 2, 1, 1]
    a.check_integrity(owners_of([blocks, again]))


def test_last_token_block_is_never_a_hit():
    a = BlockAllocator(num_blocks=6, block_size=4)
    tokens = list(range(8))  # exactly two full blocks
    blocks, _ = take(a, tokens)
    a.commit(blocks, tokens, 8)
    again, cached = take(a, tokens)
    # the block holding the last token is recomputed to produce logits
    assert (again, cached) == ([0, 2], 4)


def test_free_releases_tail_first_and_lru_eviction_order():
    a = BlockAllocator(num_blocks=4, block_size=2)
    seq_a = [1, 2, 3, 4]
    seq_b = [5, 6, 7, 8]
    ba, _ = take(a, seq_a)
    bb, _ = take(a, seq_b)
    assert (ba, bb) == ([0, 1], [2, 3])
    a.commit(ba, seq_a, 4)
    a.commit(bb, seq_b, 4)
    a.free(ba)  # tail first: 1 then 0 join the LRU
    a.free(bb)  # then 3, 2
    assert list(a._evictable) == [1, 0, 3, 2]
    a.check_integrity(owners_of([]))
    got = a.allocate([9, 10, 11])  # no hit: evicts the two least recently freed
    fresh, cached = got.block_ids, got.cached_tokens
    assert (fresh, cached) == ([1, 0], 0)
    # and says so, with the hashes, while their KV is still intact (nobody wrote yet)
    h0 = chain_hash(None, seq_a[:2])
    assert got.evicted == (Evicted(1, chain_hash(h0, seq_a[2:])), Evicted(0, h0))
    assert list(a._evictable) == [3, 2]
    # the evicted prefix is gone, the other survives
    assert a.match_prefix(seq_a + [0]) == []
    assert a.match_prefix(seq_b + [0]) == [2, 3]
    a.check_integrity(owners_of([fresh]))


def test_revived_cached_blocks_leave_the_lru():
    a = BlockAllocator(num_blocks=3, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    blocks, _ = take(a, tokens)
    a.commit(blocks, tokens, 5)
    a.free(blocks)
    assert a._is_free.tolist() == [False, False, True] and list(a._evictable) == [1, 0]
    again, cached = take(a, tokens)
    assert (again, cached) == ([0, 1, 2], 4)
    assert a.num_free_blocks == 0
    with pytest.raises(NoFreeBlocks):
        a.allocate([7])
    a.check_integrity(owners_of([again]))


def test_append_grows_and_copy_on_write_of_shared_partial_block():
    a = BlockAllocator(num_blocks=6, block_size=4)
    blocks, _ = take(a, [1, 2, 3, 4, 5])  # [0, 1], block 1 holds one token
    child = a.fork(blocks)
    assert a.ref_counts[:2] == [2, 2]
    copies = a.append_slots(child, num_tokens=5, new_tokens=1).copies
    assert copies == ((1, 2),) and child == [0, 2]
    assert a.ref_counts[:3] == [2, 1, 1]
    copies = a.append_slots(child, num_tokens=6, new_tokens=3).copies  # crosses into a new block
    assert copies == () and child == [0, 2, 3]
    a.check_integrity(owners_of([blocks, child]))
    a.free(child)
    a.free(blocks)
    assert a.num_free_blocks == 6
    a.check_integrity(owners_of([]))


def test_no_free_blocks_leaves_state_untouched():
    a = BlockAllocator(num_blocks=2, block_size=2)
    blocks, _ = take(a, [1, 2, 3])
    with pytest.raises(NoFreeBlocks):
        a.append_slots(blocks, 3, 2)
    assert blocks == [0, 1]
    assert not a.can_allocate([4])
    a.check_integrity(owners_of([blocks]))


def test_duplicate_content_block_stays_private():
    a = BlockAllocator(num_blocks=4, block_size=2)
    b1, _ = take(a, [1, 2, 3])
    b2, _ = take(a, [1, 2, 3])  # not committed yet, so no hit
    a.commit(b1, [1, 2, 3], 3)
    a.commit(b2, [1, 2, 3], 3)
    assert a.block_hash[b1[0]] is not None and a.block_hash[b2[0]] is None
    a.check_integrity(owners_of([b1, b2]))


# -- property test ------------------------------------------------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "append", "fork", "free", "commit"]),
        st.integers(0, 7),  # which live sequence
        st.lists(st.integers(0, 2), min_size=1, max_size=9),  # tokens (small alphabet: hits)
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), caching=st.booleans())
def test_random_operation_sequences_keep_integrity(ops, block_size, caching):
    a = BlockAllocator(num_blocks=12, block_size=block_size, enable_prefix_caching=caching)
    live: list[tuple[list[int], list[int]]] = []  # (block table, tokens)
    for op, which, tokens in ops:
        target = live[which % len(live)] if live else None
        evicted, taken = (), set()
        try:
            if op == "allocate" or target is None:
                got = a.allocate(tokens)
                blocks, cached = got.block_ids, got.cached_tokens
                assert cached % block_size == 0 and cached < len(tokens)
                assert len(blocks) == a.blocks_needed(len(tokens))
                live.append((blocks, list(tokens)))
                evicted, taken = got.evicted, set(blocks)
            elif op == "append":
                blocks, seq = target
                before = set(blocks)
                evicted = a.append_slots(blocks, len(seq), len(tokens)).evicted
                taken = set(blocks) - before
                seq.extend(tokens)
                assert len(blocks) == a.blocks_needed(len(seq))
            elif op == "fork":
                blocks, seq = target
                live.append((a.fork(blocks), list(seq)))
            elif op == "free":
                live.remove(target)
                a.free(target[0])
            else:
                a.commit(target[0], target[1], len(target[1]))
        except NoFreeBlocks:
            pass
        # a cached block evicted by a call went to that very call, its hash forgotten
        for e in evicted:
            assert e.block in taken and e.hash not in a.hash_to_block
        a.check_integrity(owners_of([b for b, _ in live]))
    for blocks, _ in live:
        a.free(blocks)
    a.check_integrity(owners_of([]))
    assert a.num_free_blocks == a.num_blocks


def test_new_sequences_get_the_smallest_consecutive_run_that_fits():
    a = BlockAllocator(num_blocks=12, block_size=1, enable_prefix_caching=False)
    x, _ = take(a, [1] * 3)  # 0-2
    y, _ = take(a, [1] * 2)  # 3-4
    z, _ = take(a, [1] * 4)  # 5-8
    assert (x, y, z) == ([0, 1, 2], [3, 4], [5, 6, 7, 8])
    a.free(x)  # free runs: 0-2 (3 long) and 9-11 (3 long)
    a.free(z)  # free runs: 0-2, 5-11 (7 long)
    a.check_integrity()
    two, _ = take(a, [1] * 2)
    assert two == [0, 1]  # the 3-run is the smallest that fits
    four, _ = take(a, [1] * 4)
    assert four == [5, 6, 7, 8]
    a.check_integrity()
    # no run of 4 left (2, then 9-11): lowest ids first
    a.free(y)  # 2-4 now a run of 3
    a.check_integrity()
    scattered, _ = take(a, [1] * 5)
    assert scattered == [2, 3, 4, 9, 10]
    a.check_integrity()


def test_growth_takes_the_lowest_free_block():
    a = BlockAllocator(num_blocks=6, block_size=2, enable_prefix_caching=False)
    first, _ = take(a, [1] * 4)  # 0, 1
    second, _ = take(a, [1] * 4)  # 2, 3
    a.free(first)
    a.check_integrity()
    assert a.append_slots(second, 4, 1).copies == () and second == [2, 3, 0]
    a.check_integrity()
