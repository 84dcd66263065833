"""Where one request's KV goes: a decode worker's reserved blocks, as its Reserve answered
(the prefill worker's push and another decode worker's migration both write there)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.serving.kv_pool import RankKV, layout_from_proto, ranks_from_proto
from transfer import PoolLayout


@dataclass(frozen=True)
class Destination:
    worker_id: str
    agent_metadata: bytes
    pool: PoolLayout  # of the decode worker (its rank 0)
    block_ids: list[int]
    cached_blocks: int = 0  # leading blocks the decode worker already holds: not pushed
    fence: int = 0  # the reservation's fencing token: the notification carries it
    ranks: tuple[RankKV, ...] = ()  # a tensor-parallel decode worker's ranks 1..n-1

    @property
    def pools(self) -> list[PoolLayout]:
        return [self.pool, *(r.layout for r in self.ranks)]

    def rank_metadata(self, rank: int) -> bytes:
        return self.agent_metadata if rank == 0 else self.ranks[rank - 1].agent_metadata


def destination_from_proto(msg) -> Destination:
    """The `dest_*` fields of a PrefillRequest or a MigrateRequest."""
    return Destination(
        worker_id=msg.dest_worker_id,
        agent_metadata=msg.dest_agent_metadata,
        pool=layout_from_proto(msg.dest_layout),
        block_ids=list(msg.dest_block_ids),
        cached_blocks=msg.dest_cached_blocks,
        fence=msg.dest_fence,
        ranks=ranks_from_proto(msg.dest_ranks),
    )
