"""KVManager: the device pool's blocks and what is kept of them elsewhere, behind one API.

The scheduler and every reservation a role makes allocate through here, so that "allocate,
then reload offloaded prefix blocks" and "a cached block is evicted, keep its KV" happen in
one place:

    allocate_prompt(tokens) -> (blocks, cached tokens)
        | device prefix hits | offloaded prefix blocks reloaded | fresh blocks          |
          shared, read-only    copied back from the tiers          computed by the caller
        (never the block of the prompt's last token: its logits must be computed)

    grow(blocks, tokens, n)   -> copy-on-write pairs; room for n more tokens
    park / unpark             a preempted request's KV to the tiers and back (pdserve/kv/offload.py)
    free / commit             release a sequence; register the hashes of its computed blocks

Cached blocks the allocator evicts to make room come back from every allocation call while
their KV is still intact; with `prefix_offload` they are copied to the tiers before anything
can write into them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pdserve.kv.block_allocator import BlockAllocator, Evicted
from pdserve.kv.kv_cache import KVCache
from pdserve.kv.offload import OffloadStats, OffloadStore


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    free_blocks: int  # a new allocation can take them (free plus evictable cached)
    used_blocks: int
    offloaded: OffloadStats | None


class KVManager:
    def __init__(
        self,
        allocator: BlockAllocator,
        cache: KVCache,
        offload: OffloadStore | None = None,
        prefix_offload: bool = False,
    ) -> None:
        if prefix_offload and (offload is None or not allocator.enable_prefix_caching):
            raise ValueError("prefix_offload: needs prefix caching and at least one spill tier")
        self.allocator = allocator
        self.cache = cache
        self.offload = offload
        self.prefix_offload = prefix_offload

    # -- queries --------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by two or more owners."""
        return self.allocator.num_shared

    @property
    def prefix_caching(self) -> bool:
        return self.allocator.enable_prefix_caching

    @property
    def can_park(self) -> bool:
        return self.offload is not None

    def blocks_needed(self, num_tokens: int) -> int:
        return self.allocator.blocks_needed(num_tokens)

    def exclusive_blocks(self, block_ids: Sequence[int]) -> int:
        """How many of a sequence's blocks freeing it frees (the others are shared)."""
        return self.allocator.exclusive(block_ids)

    def can_allocate(self, token_ids: Sequence[int], hashes: list[int] | None = None) -> bool:
        """`hashes`: the sequence's known chain hashes (pdserve/kv/block_allocator.py)."""
        return self.allocator.can_allocate(token_ids, hashes=hashes)

    def shared_blocks(self, token_ids: Sequence[int]) -> list[int]:
        """Device blocks a prompt would share with cached ones (its prefix hits)."""
        return self.allocator.match_prefix(token_ids)

    # -- allocation -----------------------------------------------------------------------
    def allocate_prompt(
        self, token_ids: Sequence[int], hashes: list[int] | None = None
    ) -> tuple[list[int], int]:
        """Blocks for a new sequence -> (block ids, tokens whose KV is already in them)."""
        got = self.allocator.allocate(token_ids, hashes)
        self._keep(got.evicted)
        cached = got.cached_tokens
        if self.prefix_offload:
            cached = self._reload_prefixes(token_ids, got.block_ids, cached)
        return got.block_ids, cached

    def allocate_fresh(self, n: int) -> list[int]:
        """`n` private blocks with no prefix (a parked sequence's KV is unpacked there)."""
        got = self.allocator.allocate_fresh(n)
        self._keep(got.evicted)
        return got.block_ids

    def grow(
        self, block_ids: list[int], num_tokens: int, new_tokens: int
    ) -> tuple[tuple[int, int], ...] | None:
        """Room for `new_tokens` more (in place on block_ids) -> copy-on-write (src, dst),
        or None when the pool cannot give it (nothing changed then)."""
        got = self.allocator.try_append(block_ids, num_tokens, new_tokens)
        if got is None:
            return None
        if got.evicted:
            self._keep(got.evicted)
        return got.copies

    def commit(
        self,
        block_ids: list[int],
        token_ids: Sequence[int],
        num_computed: int,
        start: int = 0,
        hashes: list[int] | None = None,
    ) -> int:
        """Register the newly full computed blocks [start, ...) -> the next start."""
        return self.allocator.commit(block_ids, token_ids, num_computed, start, hashes)

    def free(self, block_ids: list[int]) -> None:
        self.allocator.free(block_ids)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        self.cache.copy_blocks(pairs)

    def _keep(self, evicted: tuple[Evicted, ...]) -> None:
        if self.prefix_offload:
            for e in evicted:
                self.offload.keep_prefix(e.block, e.hash)

    def _reload_prefixes(self, token_ids: Sequence[int], block_ids: list[int], cached: int) -> int:
        """After the device hits: reload the following full blocks whose prefixes are
        offloaded, in order, into the sequence's fresh blocks; -> the new cached count."""
        bs = self.block_size
        full = (len(token_ids) - 1) // bs  # never the block of the last token
        first = cached // bs
        if first >= full:
            return cached
        for i, h in enumerate(self.allocator.prefix_hashes(token_ids, full)[first:], first):
            if not self.offload.load_prefix(h, block_ids[i]):
                break
            cached = (i + 1) * bs
        return cached

    # -- parking --------------------------------------------------------------------------
    def park(self, request_id: str, block_ids: list[int]) -> bool:
        """Keep a preempted request's computed blocks in the tiers (the caller frees them)."""
        return self.offload is not None and self.offload.park(request_id, block_ids) is not None

    def unpark(self, request_id: str, block_ids: list[int]) -> bool:
        return self.offload.unpark(request_id, block_ids)

    def drop_parked(self, request_id: str) -> None:
        if self.offload is not None:
            self.offload.drop_parked(request_id)

    def is_parked(self, request_id: str) -> bool:
        return self.offload is not None and self.offload.parked_blocks(request_id) > 0

    def parked_blocks(self, request_id: str) -> int:
        return self.offload.parked_blocks(request_id) if self.offload is not None else 0

    def tiers_take(self, sizes: list[int]) -> bool:
        """Whether the spill tiers would take parks of these many blocks, in order."""
        return self.offload is not None and self.offload.can_take(sizes)

    def copy_parked(self, request_id: str, into: torch.Tensor) -> bool:
        return self.offload is not None and self.offload.copy_parked(request_id, into)

    # -- accounting -----------------------------------------------------------------------
    def stats(self) -> PoolStats:
        return PoolStats(
            num_blocks=self.allocator.num_blocks,
            free_blocks=self.allocator.num_free_blocks,
            used_blocks=self.allocator.num_used_blocks,
            offloaded=self.offload.stats() if self.offload is not None else None,
        )

    def check_integrity(self, owners: dict[int, int], parked: Iterable[str]) -> None:
        """Reference counts equal the block tables' holders (`owners`), and the parked KV is
        exactly that of the parked requests."""
        self.allocator.check_integrity(owners)
        if self.offload is not None:
            self.offload.check_integrity(parked)
        else:
            assert not set(parked), "requests parked without a spill tier"

    def close(self) -> None:
        if self.offload is not None:
            self.offload.close()
