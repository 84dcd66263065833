"""The paged KV cache: block allocator (bookkeeping) and the pool tensors (storage)."""

from pdserve.kv.block_allocator import BlockAllocator, NoFreeBlocks, chain_hash
from pdserve.kv.kv_cache import KVCache

__all__ = ["BlockAllocator", "KVCache", "NoFreeBlocks", "chain_hash"]
