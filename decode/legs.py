"""One round of a live migration's WRITEs over every rank of the moving side.

A move between two decode workers is a set of legs, one per route of transfer/heads.py:
our rank `rank` sends its heads of the request's blocks to the destination's rank
`dest_rank` (equal groups pair rank i with rank i, whole blocks; unequal ones move runs of
heads). Between two workers without tensor parallelism that is one leg, rank 0 to rank 0.
The last round's WRITE of each leg carries its own notification, part k of the legs, so the
destination counts the move as arrived when every part has (decode/reservations.py), as it
does a tensor-parallel prefill group's push.

Rank 0 posts its legs over the worker's agent; ranks 1..n-1 post theirs over their own
(decode/rank.py), told by `rank_call`. A round is posted, waited for and released as one.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np

from pdserve.engine.tp_group import RankFailed  # a rank of our group is gone
from pdserve.serving.destination import Destination
from transfer import Transfer, TransferFailed, XferState, notification
from transfer.writes import HeadRoute, Peers, PoolSide, block_runs, write_layers

RANK_EXTENSION = "decode.rank:DecodeRank"  # what a decode worker's ranks 1..n-1 run


RANK_POLL_S = 0.002  # between polls of the ranks' WRITEs (each poll waits for their step)


class RoundFailed(Exception):
    """A round's WRITEs could not all be posted, or one failed or was late. `wrote`: some
    WRITE was posted and may still land (the destination's blocks stay fenced).
    `retryable`: False when a rank of our group is gone (the worker leaves service)."""

    def __init__(self, message: str, wrote: bool, retryable: bool = True) -> None:
        super().__init__(message)
        self.wrote = wrote
        self.retryable = retryable


@dataclass(frozen=True)
class Leg:
    rank: int  # ours, that sends
    dest_rank: int
    heads: HeadRoute | None  # None: whole blocks


def plan_legs(endpoint, dest: Destination) -> list[Leg]:
    """The legs of a move from `endpoint` (ours: a KVEndpoint) into `dest` (raises
    HandshakeRefused when the two pools cannot be mapped)."""
    pools = dest.pools
    return [Leg(r.src, r.dst, endpoint.head_route(r, pools)) for r in endpoint.routes_to(pools)]


def _peer(dest: Destination, leg: Leg) -> tuple:
    """What Peers.side needs of the leg's destination rank: (key, metadata, pool)."""
    rank = leg.dest_rank
    return (dest.worker_id, rank), dest.rank_metadata(rank), dest.pools[rank]


def _rank_legs(legs: list[Leg], dest: Destination, notes: list[bytes]) -> dict[int, list[dict]]:
    """The legs of ranks 1..n-1 as they travel to them, by rank."""
    out: dict[int, list[dict]] = {}
    for leg, note in zip(legs, notes):
        if leg.rank > 0:
            key, metadata, pool = _peer(dest, leg)
            out.setdefault(leg.rank, []).append(
                {
                    "peer_key": key,
                    "metadata": metadata,
                    "pool": pool,
                    "heads": leg.heads,
                    "notif": note,
                }
            )
    return out


def rank_call(worker, op: str, *args, wrote: bool = True):
    """`op` on ranks 1..n-1 -> their answers; RoundFailed (not retryable) when the group is
    gone meanwhile."""
    try:
        return worker.core.rank_call(op, *args)
    except RankFailed as e:
        raise RoundFailed(f"a rank of this worker is gone: {e}", wrote, retryable=False) from None


def connect(worker, peers: Peers, legs: list[Leg], dest: Destination) -> None:
    """Every rank adds the destination ranks its legs go to (RoundFailed if one cannot):
    before the request stops, since a first connection is slow."""
    with worker.agent_lock:
        for leg in legs:
            if leg.rank == 0:
                try:
                    peers.side(*_peer(dest, leg))
                except (ValueError, RuntimeError) as e:  # metadata it cannot use
                    raise RoundFailed(str(e), False) from None
    if worker.core.tp_size == 1:
        return
    notes = [b""] * len(legs)
    for error in rank_call(worker, "migrate_connect", _rank_legs(legs, dest, notes), wrote=False):
        if error is not None:
            raise RoundFailed(f"a rank cannot reach the destination: {error}", False)


def stage_ranks(worker, legs: list[Leg], key: str, request_id: str) -> bool:
    """Ranks 1..n-1 that send (have legs) stage their shard of a parked request -> whether
    every one did."""
    if worker.core.tp_size == 1:
        return True
    senders = sorted({leg.rank for leg in legs if leg.rank > 0})
    return all(rank_call(worker, "migrate_stage", key, request_id, senders, wrote=False))


def release_ranks(worker, key: str, landed: bool) -> None:
    """Ranks 1..n-1 let the move's round go (twice is harmless); a group gone meanwhile
    holds nothing any more."""
    if worker.core.tp_size == 1:
        return
    with contextlib.suppress(RankFailed):
        worker.core.rank_call("migrate_release", key, landed)


class Round:
    """The WRITEs of one round: `post()`, then `wait()`, then `release()` (always)."""

    def __init__(self, worker, peers: Peers, legs: list[Leg], dest: Destination, key: str):
        self.worker, self.peers, self.legs, self.dest, self.key = worker, peers, legs, dest, key
        self._mine: list[Transfer] = []
        self._ranks = worker.core.tp_size > 1  # every rank answers, legs or none
        self.posted = False  # some WRITE was posted (it may land whatever happens next)

    def post(
        self,
        local: PoolSide,
        src: np.ndarray,
        dst: np.ndarray,
        notify: str | None,
        staged: bool = False,
    ) -> int:
        """WRITE blocks `src` (of `local` on rank 0; on the others of their pool, or of what
        they staged when `staged`) into the destination's `dst`, every layer; the last
        round names the destination's request in `notify` -> bytes posted."""
        worker, dest = self.worker, self.dest
        layers = worker.core.model_config.num_layers
        notes = [
            notification(notify, dest.fence, k, len(self.legs)) if notify is not None else b""
            for k in range(len(self.legs))
        ]
        blocks = (src, dst, block_runs(src, dst))
        nbytes = 0
        with worker.agent_lock:
            for leg, note in zip(self.legs, notes):
                if leg.rank > 0:
                    continue
                peer, remote = self.peers.side(*_peer(dest, leg))
                try:
                    xfer, n = write_layers(
                        worker.endpoint.agent,
                        peer,
                        range(layers),
                        local,
                        remote,
                        blocks,
                        note,
                        leg.heads,
                    )
                except TransferFailed as e:
                    raise RoundFailed(f"a WRITE could not be posted: {e}", self.posted) from None
                self._mine.append(xfer)
                self.posted = True
                nbytes += n
        if self._ranks:
            self.posted = True  # a rank may have posted some before it failed
            others = _rank_legs(self.legs, dest, notes)
            for answer in rank_call(
                worker, "migrate_post", self.key, others, src.tolist(), dst.tolist(), layers, staged
            ):
                nbytes += answer["nbytes"]
                if answer["error"] is not None:
                    raise RoundFailed(f"a rank's WRITE: {answer['error']}", True)
        return nbytes

    def wait(self, deadline: float, poll_s: float) -> None:
        """Until every WRITE of the round is complete (RoundFailed when one failed, or at
        `deadline`)."""
        worker = self.worker
        while True:
            try:
                with worker.agent_lock:
                    states = [x.state() for x in self._mine]
            except TransferFailed as e:  # posted, then lost track of: it may still land
                raise RoundFailed(f"a WRITE failed: {e}", True) from None
            if XferState.FAILED in states:
                raise RoundFailed("a WRITE failed", True)
            done = all(s is XferState.DONE for s in states)
            asked = done and self._ranks
            if asked:
                polled = rank_call(worker, "migrate_poll", self.key)
                failed = [p for p in polled if p.startswith("failed")]
                if failed:
                    raise RoundFailed(f"a rank's WRITE {failed[0]}", True)
                done = all(p == "done" for p in polled)
            if done:
                return
            if time.monotonic() > deadline:
                raise RoundFailed("the move was not done by its deadline", True)
            time.sleep(max(poll_s, RANK_POLL_S) if asked else poll_s)

    def take(self) -> list[Transfer]:
        """Rank 0's transfers of the round, no longer the round's to release (a staged
        buffer's: kept with it while they may still read it, transfer/retiring.py)."""
        mine, self._mine = self._mine, []
        return mine

    def release(self, landed: bool) -> None:
        """Every transfer of the round released; `landed`: nothing of it is in flight."""
        worker = self.worker
        with worker.agent_lock:
            for xfer in self._mine:
                xfer.release()
        self._mine = []
        if self._ranks:
            release_ranks(worker, self.key, landed)
