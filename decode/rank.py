"""A tensor-parallel decode worker's ranks 1..n-1 during a live migration: each sends its own
KV heads of the moving request, from its pool (or from its shard of the request's parked KV)
over its own transfer agent, straight into the destination's ranks. Rank 0 plans the move's
legs and drives its rounds (decode/legs.py); per round a rank runs

    migrate_connect(legs)           (before anything stops) add the peers its legs go to
    migrate_stage(key, request_id)  (a parked request) its shard unpacked from its tier into
                                    a staging buffer registered with its agent -> ok
    migrate_post(key, legs, ...)    one WRITE per leg of this rank -> bytes, error
    migrate_poll(key)               "done", "pending" or "failed: why"
    migrate_release(key, landed)    the round's transfers released; a staging buffer
                                    deregistered once nothing can still read it (kept
                                    with its transfers until they end: transfer/retiring.py,
                                    looked at with every step's notifications)

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
from transfer.retiring import Retiring
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
        self.retiring: Retiring | None = None  # staging a lost WRITE may still read

    def _legs(self, legs: dict[int, list[dict]]) -> list[dict]:
        return legs.get(self.state.spec.rank, [])

    def _ready(self) -> None:
        if self.local is None:  # the agent exists from op_endpoint on
            self.local = pool_side(self.agent, self.layout)
            self.peers = Peers(self.agent)
            self.retiring = Retiring(self.agent)

    def op_notifications(self) -> list[bytes]:
        """The base class's, and failed moves' staging let go once nothing reads it."""
        notes = super().op_notifications()
        if self.retiring:
            with contextlib.suppress(Exception):  # never a reason to fail a step
                self.retiring.sweep()
        return notes

    def op_migrate_connect(self, legs: dict[int, list[dict]]) -> str | None:
        """Add the destination ranks this rank's legs go to (before the request stops: a
        first connection is slow) -> None, or what went wrong."""
        try:
            self._ready()
            for leg in self._legs(legs):
                self.peers.side(leg["peer_key"], leg["metadata"], leg["pool"])
        except Exception as e:  # noqa: BLE001 - the answer carries it to rank 0
            return f"{type(e).__name__}: {e}"
        return None

    def op_migrate_stage(self, key: str, request_id: str, senders: list[int]) -> bool:
        """This rank's shard of a parked request into a staging buffer registered with the
        agent, when the rank is one of the `senders` (it has legs) -> False when its shard
        is lost (or the rank has no tier). A move left under `key` by an earlier try goes
        first (its buffer kept aside: a WRITE of it may still be in flight)."""
        self.op_migrate_release(key, False)
        if self.state.spec.rank not in senders:
            return True
        st = self.state
        region = None
        try:
            self._ready()
            staging = st.parked_shard(request_id)
            if staging is None:
                return False
            region = self.agent.register(staging)
            side = PoolSide(pool_geometry(st.config, staging, st.cache.block_dim), region, None)
        except Exception:  # noqa: BLE001 - the move fails, the group goes on
            if region is not None:
                with contextlib.suppress(Exception):
                    self.agent.deregister(region)
            return False
        self.moves[key] = _Move(staging=staging, side=side)
        return True

    def op_migrate_post(
        self,
        key: str,
        legs: dict[int, list[dict]],
        src: list[int],
        dst: list[int],
        layers: int,
        staged: bool,
    ) -> dict:
        """WRITE blocks `src` (of the pool; of what was staged under `key` when `staged`)
        into `dst` for each of this rank's `legs` -> bytes posted, error."""
        mine = self._legs(legs)
        move = self.moves.get(key)
        if not staged:
            self.op_migrate_release(key, False)  # nothing of an earlier try is reused
            move = self.moves[key] = _Move()
        elif mine and (move is None or move.side is None):
            return {"nbytes": 0, "error": f"nothing staged for {key!r}"}
        elif move is None:
            move = self.moves[key] = _Move()
        nbytes = 0
        try:
            self._ready()
            local = move.side if staged else self.local
            s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
            blocks = (s, d, block_runs(s, d))
            for leg in mine:
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
        (or when none of this rank's WRITEs was posted), else it is kept, with the
        transfers that may still read it, until they have ended. Releasing a key twice
        does nothing."""
        move = self.moves.pop(key, None)
        if move is None:
            return
        if move.staging is not None and move.transfers and not landed:
            self.retiring.keep(move.staging, move.side.region, move.transfers)
            return
        for xfer in move.transfers:
            with contextlib.suppress(Exception):  # else released with the agent
                xfer.release()
        if move.staging is not None:
            with contextlib.suppress(Exception):  # a region gone with its agent
                self.agent.deregister(move.side.region)

    def close(self) -> None:
        for key in list(self.moves):
            self.op_migrate_release(key, False)
        super().close()
