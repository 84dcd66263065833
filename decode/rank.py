"""A tensor-parallel decode worker's ranks 1..n-1 during a live migration: each sends its own
KV heads of the moving request, from its pool (or from its shard of the request's parked KV)
over its own transfer agent, straight into the destination's ranks. Rank 0 plans the move's
legs and drives its rounds (decode/legs.py); per round a rank runs

    migrate_stage(key, request_id)  (a parked request) its shard unpacked from its tier into
                                    a staging buffer registered with its agent -> ok
    migrate_post(key, legs, ...)    one WRITE per leg of this rank -> bytes, error
    migrate_poll(key)               "done", "pending" or "failed: why"
    migrate_release(key, landed)    the round's transfers released; the staging buffer
                                    deregistered once nothing can still read it

Every op answers and none raises: an op that failed would take the whole group out of
service (pdserve/engine/tp_group.py), where a failed move only leaves the request where it
was. Installed on each rank with `extend("decode.rank:DecodeRank")`; receiving pushes is
the base class's (pdserve/serving/rank_kv.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.serving.kv_pool import pool_geometry
from pdserve.serving.rank_kv import RankEndpoint
from transfer import Transfer, XferState
from transfer.writes import Peers, PoolSide, block_runs, pool_side, write_layers


@dataclass
class _Move:
    transfers: list[Transfer] = field(default_factory=list)
    staging: torch.Tensor | None = None  # a parked request's shard, registered as `side`
    side: PoolSide | None = None


class DecodeRank(RankEndpoint):
    def __init__(self, state) -> None:
        super().__init__(state)
        self.peers: Peers | None = None  # keyed (destination worker id, its rank)
        self.local: PoolSide | None = None
        self.moves: dict[str, _Move] = {}
        self.retired: list[torch.Tensor] = []  # staging a lost WRITE may still read

    def op_migrate_stage(self, key: str, request_id: str) -> bool:
        """This rank's shard of a parked request into a staging buffer registered with the
        agent -> False when it is lost (or the rank has no tier)."""
        st = self.state
        try:
            n = st.offload.parked_blocks(request_id) if st.offload is not None else 0
            if n <= 0:
                return False
            pool, dim = st.cache.pool, st.cache.block_dim
            shape = (*pool.shape[:dim], n, *pool.shape[dim + 1 :])
            staging = torch.empty(shape, dtype=pool.dtype, device=pool.device)
            if not st.offload.copy_parked(request_id, staging):
                return False
            region = self.agent.register(staging)
        except Exception:  # noqa: BLE001 - the move fails, the group goes on
            return False
        geometry = pool_geometry(st.config, staging, dim)
        self.moves[key] = _Move(staging=staging, side=PoolSide(geometry, region, None))
        return True

    def op_migrate_post(
        self, key: str, legs: dict[int, list[dict]], src: list[int], dst: list[int], layers: int
    ) -> dict:
        """WRITE blocks `src` (of the pool, or of the staging buffer when one was staged
        under `key`) into `dst` for each of this rank's `legs` -> bytes posted, error."""
        move = self.moves.setdefault(key, _Move())
        nbytes = 0
        try:
            if self.local is None:
                self.local = pool_side(self.agent, self.layout)
                self.peers = Peers(self.agent)
            local = move.side or self.local
            s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
            blocks = (s, d, block_runs(s, d))
            for leg in legs.get(self.state.spec.rank, []):
                peer, remote = self.peers.side(leg["peer_key"], leg["metadata"], leg["pool"])
                notif, heads = leg["notif"], leg["heads"]
                xfer, n = write_layers(
                    self.agent, peer, range(layers), local, remote, blocks, notif, heads
                )
                move.transfers.append(xfer)
                nbytes += n
        except Exception as e:  # noqa: BLE001 - the answer carries it to rank 0
            return {"nbytes": nbytes, "error": f"{type(e).__name__}: {e}"}
        return {"nbytes": nbytes, "error": None}

    def op_migrate_poll(self, key: str) -> str:
        move = self.moves.get(key)
        if move is None:
            return "done"
        try:
            states = [x.state() for x in move.transfers]
        except Exception as e:  # noqa: BLE001
            return f"failed: {type(e).__name__}: {e}"
        if XferState.FAILED in states:
            return "failed: a WRITE failed"
        return "done" if all(s is XferState.DONE for s in states) else "pending"

    def op_migrate_release(self, key: str, landed: bool) -> None:
        """The round is over: its transfers released; a staging buffer goes once `landed`
        (nothing in flight), else it is kept until the rank closes."""
        move = self.moves.pop(key, None)
        if move is None:
            return
        for xfer in move.transfers:
            with contextlib.suppress(Exception):  # else released with the agent
                xfer.release()
        if move.staging is None:
            return
        if landed:
            try:
                self.agent.deregister(move.side.region)
            except Exception:  # noqa: BLE001
                self.retired.append(move.staging)
        else:
            self.retired.append(move.staging)

    def close(self) -> None:
        for key in list(self.moves):
            self.op_migrate_release(key, False)
        super().close()
