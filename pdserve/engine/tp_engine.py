"""An engine core over a tensor-parallel group: rank 0's runner, pool and offloaded KV
mirror every device-side operation on the other ranks (pdserve/engine/tp_group.py).

The scheduler, allocator and admission run once, on rank 0, and see one pool: block b is
block b on every rank, each holding its own KV heads of it (MLA: the whole latent, the
same on every rank). So the group's pool has the blocks of one rank and the bytes of all of
them; every rank's spill tiers park its own shard of a request, and a park or a reload
counts only if every rank's did (a rank whose tier failed makes the others drop theirs:
the request is recomputed on all of them, never resumed from mixed KV).

    TPRunner      a step: the chunks go to every rank, each runs its shard, rank 0 samples
    TPCache       copy-on-write block copies on every rank
    TPOffload     park / unpark / prefixes on every rank, consistent (the OffloadStore API)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from pdserve.engine.batch import RunResult, ScheduledChunk
from pdserve.engine.memory import RankMemory, rank_memory
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tp_group import TPGroup
from pdserve.kv import KVCache
from pdserve.kv.offload import OffloadedKV, OffloadStats
from pdserve.parallel.comm import RankFailed


class TPRunner:
    def __init__(self, local: ModelRunner, group: TPGroup) -> None:
        self.local = local
        self.group = group

    @property
    def tp_size(self) -> int:
        return self.group.size

    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        on_layer_done: Callable[[int], None] | None = None,
        rank_work: list | None = None,
    ) -> RunResult:
        """`rank_work[r - 1]`: what rank r's extension does during this step (its answers:
        `collect()` afterwards)."""
        plain = [(c.token_ids, c.start, c.block_ids, c.sample) for c in chunks]
        if rank_work is None:
            self.group.send("execute", plain)
        else:
            self.group.send_each("execute", [(plain, work) for work in rank_work], answered=True)
        try:
            return self.local.execute(chunks, on_layer_done)
        except RankFailed as e:  # a collective of the step: the whole group is out
            raise self.group.fail(str(e)) from e

    def collect(self) -> list:
        """The other ranks' answers to the last step sent with work."""
        return self.group.collect("execute")

    def memory(self) -> list[RankMemory]:
        own = rank_memory(0, self.local.model, self.local.kv_cache)
        return [own, *(RankMemory(**m) for m in self.group.call("memory"))]

    def close(self) -> None:
        self.group.close()


class TPCache:
    """Rank 0's KVCache, with block copies made on every rank."""

    def __init__(self, local: KVCache, group: TPGroup) -> None:
        self.local = local
        self.group = group

    def __getattr__(self, name: str):  # the pool's shape and tensors: rank 0's
        return getattr(self.local, name)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self.group.send("copy_blocks", pairs)
        self.local.copy_blocks(pairs)


class TPOffload:
    """OffloadStore over every rank's tiers: each parks its own shard, all or none."""

    def __init__(self, local: OffloadedKV, group: TPGroup) -> None:
        self.local = local
        self.group = group

    def park(self, request_id: str, block_ids: list[int]) -> str | None:
        others = self.group.call("park", request_id, block_ids)
        tier = self.local.park(request_id, block_ids)
        if tier is None or any(t is None for t in others):
            self.drop_parked(request_id)  # where it did go: all or none
            return None
        return tier

    def unpark(self, request_id: str, block_ids: list[int]) -> bool:
        others = self.group.call("unpark", request_id, block_ids)
        return self.local.unpark(request_id, block_ids) and all(others)

    def drop_parked(self, request_id: str) -> None:
        self.group.send("drop_parked", request_id)
        self.local.drop_parked(request_id)

    def parked_blocks(self, request_id: str) -> int:
        return self.local.parked_blocks(request_id)  # every rank parks all or none

    def can_take(self, sizes: list[int]) -> bool:
        return self.local.can_take(sizes)  # every rank's tiers are alike and park alike

    def copy_parked(self, request_id: str, into) -> bool:
        """Rank 0's shard only: a live migration has each other rank stage its own where it
        is (decode/rank.py), since `into` lives in this process."""
        return self.local.copy_parked(request_id, into)

    def keep_prefix(self, block: int, h: int) -> None:
        kept = self.group.call("keep_prefix", block, h)  # whether each rank now holds it
        self.local.keep_prefix(block, h)
        if not (self.local.has_prefix(h) and all(kept)):
            self._drop_prefix(h)

    def _drop_prefix(self, h: int) -> None:
        self.group.send("drop_prefix", h)
        self.local.drop_prefix(h)

    def load_prefix(self, h: int, block: int) -> bool:
        others = self.group.call("load_prefix", h, block)
        if self.local.load_prefix(h, block) and all(others):
            return True
        self._drop_prefix(h)  # kept on some ranks only: forget it everywhere
        return False

    def stats(self) -> OffloadStats:
        """Rank 0's books (every rank holds the same entries, each of its own bytes)."""
        return self.local.stats()

    def check_integrity(self, parked: Iterable[str] | None = None) -> None:
        parked = None if parked is None else list(parked)
        self.local.check_integrity(parked)
        if parked is not None:
            self.group.call("check", parked)

    def close(self) -> None:
        self.local.close()
