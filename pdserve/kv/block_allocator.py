"""Paged KV block allocator: reference counts, prefix caching, LRU reuse of cached blocks.

Every block is in exactly one of three states:

    FREE       ref 0, no hash         `_is_free` (lowest id first; runs for new sequences)
    CACHED     ref 0, hashed          in `_evictable` (LRU: oldest freed first)
    USED       ref >= 1               owned by the sequences holding it

A full block's hash chains its parent's: h_i = H(h_{i-1}, tokens of block i), so equal hashes
mean equal prefixes. A new sequence reuses the longest chain of cached full blocks of its
prompt (never the block holding the prompt's last token, which must be computed to produce
logits). Fresh blocks come from FREE first, then from CACHED in LRU order (dropping the
hash). Freeing a sequence releases its blocks tail first, so its prefix stays cached longest.

A new sequence's fresh blocks are taken as one run of consecutive ids when FREE has one
(the smallest run that fits, so large runs survive); otherwise, like single blocks for a
growing sequence, lowest ids first. Consecutive blocks are adjacent in the KV pool, so a
handoff of them is one descriptor per layer plane instead of one per block.

Every call that takes blocks returns the cached blocks it evicted to do so (`Evicted`:
block, hash), whose KV is still intact until the caller writes into them: whoever keeps
evicted prefixes elsewhere (pdserve/kv/manager.py) copies them out first. The allocator
itself only keeps books and never touches KV.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class NoFreeBlocks(RuntimeError):
    """The pool cannot supply the blocks asked for; the caller should wait or preempt."""


@dataclass(frozen=True)
class Evicted:
    """A cached block handed out again: its KV (of the prefix hashed `hash`) is still in
    the pool until the new owner writes into it."""

    block: int
    hash: int


@dataclass(frozen=True)
class Allocation:
    block_ids: list[int]
    cached_tokens: int  # leading tokens whose KV the blocks already hold (prefix hits)
    evicted: tuple[Evicted, ...] = ()


@dataclass(frozen=True)
class Growth:
    copies: tuple[tuple[int, int], ...] = ()  # copy-on-write (src, dst), copied before writing
    evicted: tuple[Evicted, ...] = ()


NO_GROWTH = Growth()  # the common case: the last block has room and is not shared


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    digest = hashlib.blake2b(digest_size=16)
    digest.update((parent or 0).to_bytes(16, "little"))
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little")


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self._is_free = np.ones(num_blocks, dtype=bool)
        self._num_free = num_blocks
        self._free_heap: list[int] = list(range(num_blocks))  # may hold stale ids
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # blocks held by two or more owners (a shared prefix, a fork): while there are none,
        # no two owners' block tables have a block in common (admission reads this)
        self.num_shared = 0

    # -- queries --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take (free plus evictable cached)."""
        return self._num_free + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def exclusive(self, block_ids: Sequence[int]) -> int:
        """How many of `block_ids` one owner alone holds: what freeing them frees."""
        if not self.num_shared:
            return len(block_ids)
        refs = self.ref_counts
        return sum(refs[b] == 1 for b in block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def prefix_hashes(self, token_ids: Sequence[int], num_blocks: int) -> list[int]:
        """The chain hashes of the first `num_blocks` full blocks of `token_ids`."""
        hashes, parent, bs = [], None, self.block_size
        for i in range(num_blocks):
            parent = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def match_prefix(self, token_ids: Sequence[int], hashes: list[int] | None = None) -> list[int]:
        """Block ids of the longest cached prefix (full blocks, last token excluded).

        `hashes`: the sequence's chain hashes known so far (as commit() keeps them), used
        and extended here; a block is hashed only when every block before it hit, so a
        long sequence that waits is not hashed from its start at every step."""
        if not self.enable_prefix_caching:
            return []
        if hashes is None:
            hashes = []
        hits, bs, lookup = [], self.block_size, self.hash_to_block.get
        for i in range((len(token_ids) - 1) // bs):
            if i == len(hashes):
                parent = hashes[i - 1] if i else None
                hashes.append(chain_hash(parent, token_ids[i * bs : (i + 1) * bs]))
            block = lookup(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(
        self, token_ids: Sequence[int], reserve: int = 0, hashes: list[int] | None = None
    ) -> bool:
        """Whether `allocate(token_ids)` would succeed leaving `reserve` blocks free."""
        hits = self.match_prefix(token_ids, hashes)
        in_use = sum(map(bool, map(self.ref_counts.__getitem__, hits)))
        revived = len(hits) - in_use  # hits that leave the evictable pool
        fresh = self.blocks_needed(len(token_ids)) - len(hits)
        return fresh + revived + reserve <= self.num_free_blocks

    # -- mutations ------------------------------------------------------------------------
    def allocate(self, token_ids: Sequence[int], hashes: list[int] | None = None) -> Allocation:
        """Blocks for a new sequence of `token_ids`: its cached prefix blocks (shared), then
        fresh ones (`hashes` as for match_prefix)."""
        if not token_ids:
            raise ValueError("token_ids: cannot allocate an empty sequence")
        if hashes is None:
            hashes = []
        if not self.can_allocate(token_ids, hashes=hashes):
            raise NoFreeBlocks(f"{self.blocks_needed(len(token_ids))} blocks needed")
        hits = self.match_prefix(token_ids, hashes)
        for block in hits:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            elif self.ref_counts[block] == 1:
                self.num_shared += 1
            self.ref_counts[block] += 1
        evicted: list[Evicted] = []
        fresh = self._take_run(self.blocks_needed(len(token_ids)) - len(hits), evicted)
        return Allocation(hits + fresh, len(hits) * self.block_size, tuple(evicted))

    def allocate_fresh(self, n: int) -> Allocation:
        """`n` private blocks with no prefix (a reloaded sequence's KV goes there)."""
        if n > self.num_free_blocks:
            raise NoFreeBlocks(f"{n} blocks needed, {self.num_free_blocks} free")
        evicted: list[Evicted] = []
        return Allocation(self._take_run(n, evicted), 0, tuple(evicted))

    def append_slots(self, block_ids: list[int], num_tokens: int, new_tokens: int) -> Growth:
        """Grow a sequence of `num_tokens` by `new_tokens`, in place on `block_ids`.

        A shared last block that would be written is replaced by a private copy: the copy
        pairs (src, dst) come back, and the caller copies src's contents first.
        """
        needed = self.blocks_needed(num_tokens + new_tokens) - len(block_ids)
        writes_last = num_tokens % self.block_size != 0
        cow = writes_last and self.ref_counts[block_ids[-1]] > 1
        if needed <= 0 and not cow:
            return NO_GROWTH
        if needed + int(cow) > self.num_free_blocks:
            raise NoFreeBlocks(f"{needed + int(cow)} blocks needed")
        copies, evicted = [], []
        if cow:
            src = block_ids[-1]
            dst = self._take(evicted)
            self.ref_counts[src] -= 1
            if self.ref_counts[src] == 1:
                self.num_shared -= 1
            block_ids[-1] = dst
            copies.append((src, dst))
        block_ids.extend(self._take(evicted) for _ in range(needed))
        return Growth(tuple(copies), tuple(evicted))

    def try_append(self, block_ids: list[int], num_tokens: int, new_tokens: int) -> Growth | None:
        """append_slots() when it fits, else None and nothing changed."""
        bs = self.block_size
        needed = -(-(num_tokens + new_tokens) // bs) - len(block_ids)
        cow = num_tokens % bs != 0 and self.ref_counts[block_ids[-1]] > 1
        if needed <= 0 and not cow:
            return NO_GROWTH
        if needed + int(cow) > self.num_free_blocks:
            return None
        return self.append_slots(block_ids, num_tokens, new_tokens)

    def fork(self, block_ids: list[int]) -> list[int]:
        """Share all of a sequence's blocks with a new sequence (refcounts + 1)."""
        for block in block_ids:
            assert self.ref_counts[block] > 0, f"fork of unowned block {block}"
            if self.ref_counts[block] == 1:
                self.num_shared += 1
            self.ref_counts[block] += 1
        return list(block_ids)

    def commit(
        self,
        block_ids: list[int],
        token_ids: Sequence[int],
        num_computed: int,
        start: int = 0,
        hashes: list[int] | None = None,
    ) -> int:
        """Register the hashes of the full blocks [start, full) whose KV is now computed (for
        later reuse) -> full, the next call's start.

        `hashes` are the sequence's chain hashes of its full blocks so far, extended here
        as blocks fill: a sequence hashes each of its blocks once in its life (a long one
        committed every step would otherwise hash from its first block again and again).
        A block whose content is cached already under another block stays private."""
        full = min(num_computed // self.block_size, len(block_ids))
        if not self.enable_prefix_caching or full <= start:
            return max(start, full)
        if hashes is None:
            hashes = []
        bs = self.block_size
        for i in range(len(hashes), full):
            parent = hashes[i - 1] if i else None
            hashes.append(chain_hash(parent, token_ids[i * bs : (i + 1) * bs]))
        for i in range(start, full):
            block, h = block_ids[i], hashes[i]
            if self.block_hash[block] is not None or h in self.hash_to_block:
                continue  # known already, or an identical block is cached: keep this private
            self.block_hash[block] = h
            self.hash_to_block[h] = block
        return full

    def free(self, block_ids: list[int]) -> None:
        """Release a sequence's blocks, tail first."""
        for block in reversed(block_ids):
            assert self.ref_counts[block] > 0, f"double free of block {block}"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 1:
                self.num_shared -= 1
            elif self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self._release(block)
                else:
                    self._evictable[block] = None

    def _release(self, block: int) -> None:
        self._is_free[block] = True
        self._num_free += 1
        heapq.heappush(self._free_heap, block)
        if len(self._free_heap) > 2 * self.num_blocks:  # drop stale entries now and then
            self._free_heap = np.flatnonzero(self._is_free).tolist()

    def _claim(self, block: int) -> int:
        assert self._is_free[block] and self.ref_counts[block] == 0
        self._is_free[block] = False
        self._num_free -= 1
        self.ref_counts[block] = 1
        return block

    def _take_run(self, n: int, evicted: list[Evicted]) -> list[int]:
        """`n` fresh blocks: the smallest run of consecutive FREE ids that fits, else `_take`."""
        if n <= 0:
            return []
        if n > 1 and self._num_free >= n:
            edges = np.diff(np.concatenate(([0], self._is_free.view(np.int8), [0])))
            starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
            fits = np.flatnonzero(ends - starts >= n)
            if fits.size:
                best = fits[np.argmin((ends - starts)[fits])]
                return [self._claim(b) for b in range(int(starts[best]), int(starts[best]) + n)]
        return [self._take(evicted) for _ in range(n)]

    def _take(self, evicted: list[Evicted]) -> int:
        """A FREE block (lowest id), else the least recently used CACHED one, whose hash is
        forgotten and which is noted in `evicted`."""
        while self._free_heap:
            block = heapq.heappop(self._free_heap)
            if self._is_free[block]:
                return self._claim(block)
        if self._evictable:
            block, _ = self._evictable.popitem(last=False)
            h = self.block_hash[block]
            assert h is not None
            evicted.append(Evicted(block, h))
            del self.hash_to_block[h]
            self.block_hash[block] = None
            assert self.ref_counts[block] == 0
            self.ref_counts[block] = 1
            return block
        raise NoFreeBlocks("pool exhausted")

    # -- invariants -----------------------------------------------------------------------
    def check_integrity(self, owners: dict[int, int] | None = None) -> None:
        """free + cached + used == total, each block in one state, hashes consistent.

        `owners` (block -> number of holders) lets a caller that knows every block table
        check the reference counts exactly.
        """
        free, cached = set(np.flatnonzero(self._is_free).tolist()), set(self._evictable)
        assert len(free) == self._num_free, "free count drifted"
        assert free <= set(self._free_heap), "free block missing from the heap"
        assert not (free & cached), "block both free and cached"
        used = {b for b in range(self.num_blocks) if self.ref_counts[b] > 0}
        assert not (used & (free | cached)), "used block on a free list"
        assert len(free) + len(cached) + len(used) == self.num_blocks, "a block is in no state"
        shared = sum(1 for r in self.ref_counts if r > 1)
        assert self.num_shared == shared, f"{self.num_shared} shared blocks counted, {shared} are"
        assert all(self.block_hash[b] is None for b in free), "free block keeps a hash"
        assert all(self.block_hash[b] is not None for b in cached), "cached block without hash"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash map points at block {b} with another hash"
        hashed = sum(1 for h in self.block_hash if h is not None)
        assert hashed == len(self.hash_to_block), "hash map and block hashes disagree"
        if owners is not None:
            for b in range(self.num_blocks):
                assert self.ref_counts[b] == owners.get(b, 0), (
                    f"block {b}: refcount {self.ref_counts[b]} but {owners.get(b, 0)} owners"
                )
