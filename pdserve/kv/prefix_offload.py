"""Offloaded prefix blocks: full blocks evicted from the device prefix cache keep their
prefix hashes in the spill tiers, and a later sequence with the same prefix reloads them
instead of computing them again.

    evicted(block, h)           the allocator is about to reuse cached block `block` (hash h):
                                its KV is copied to the tiers under h (host, then CXL, then
                                disk, as each fills), unless h is already offloaded
    extend(tokens, blocks, n)   after allocate() found n cached tokens on the device: reload
                                the following full blocks whose hashes are offloaded, in
                                order, into the sequence's fresh blocks; -> the new n

A hash names the whole prefix up to its block (pdserve/kv/block_allocator.py), so equal
hashes mean equal KV. Every block that leaves the device pool with a hash goes through
evicted(); that includes the blocks of a request preempted with `--preemption swap|tiered`
once the pool reuses them. The block holding a sequence's last token is never reloaded (its
logits must be computed), as with device hits.

Offloaded prefixes are a cache: when a tier fills, the least recently used prefix entries
go first, and a preempted request's spill always wins over them (KVSpiller calls
make_room()). A reload that fails its checksum drops the entry and stops the extension
there; those tokens are computed instead, never served from bad bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdserve.kv.block_allocator import BlockAllocator
from transfer.tiers import SpillFailed


def prefix_key(h: int) -> str:
    return f"prefix:{h:032x}"


def is_prefix_key(key: str) -> bool:
    return key.startswith("prefix:")


class PrefixOffload:
    def __init__(self, spiller, allocator: BlockAllocator) -> None:
        if not allocator.enable_prefix_caching:
            raise ValueError("prefix offload needs prefix caching (hashes) on the device")
        self.spiller = spiller  # pdserve.kv.spill.KVSpiller
        self.allocator = allocator
        self._lru: OrderedDict[int, None] = OrderedDict()  # offloaded hashes, oldest first
        self.reloaded_blocks = 0
        allocator.on_evict = self.evicted
        spiller.make_room = self.make_room

    @property
    def held_blocks(self) -> int:
        return len(self._lru)

    def __contains__(self, h: int) -> bool:
        return h in self._lru

    def evicted(self, block: int, h: int) -> None:
        if h in self._lru:
            self._lru.move_to_end(h)
            return
        while True:
            try:
                self.spiller.store_blocks(prefix_key(h), [block])
            except SpillFailed:
                if self.make_room():
                    continue
                return  # no tier room at all: this prefix is simply forgotten
            self._lru[h] = None
            return

    def make_room(self) -> bool:
        """Drop the least recently used offloaded prefix; False when there is none."""
        if not self._lru:
            return False
        h, _ = self._lru.popitem(last=False)
        self.spiller.discard(prefix_key(h))
        return True

    def extend(self, token_ids: Sequence[int], block_ids: list[int], cached: int) -> int:
        alloc, bs = self.allocator, self.allocator.block_size
        full = (len(token_ids) - 1) // bs  # never the block of the last token
        first = cached // bs
        if first >= full or not self._lru:
            return cached
        for i, h in enumerate(alloc.prefix_hashes(token_ids, full)[first:], first):
            if h not in self._lru:
                break
            if not self.spiller.copy_back(prefix_key(h), [block_ids[i]]):
                del self._lru[h]  # lost or corrupt: forget it, compute from here
                self.spiller.discard(prefix_key(h))
                break
            self._lru.move_to_end(h)
            self.reloaded_blocks += 1
            cached = (i + 1) * bs
        return cached

    def check_integrity(self) -> None:
        for h in self._lru:
            assert prefix_key(h) in self.spiller.store, f"offloaded prefix {h:x} lost its entry"
