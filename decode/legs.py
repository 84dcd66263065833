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

import time
from dataclasses import dataclass

import numpy as np

from pdserve.serving.destination import Destination
from transfer import Transfer, TransferFailed, XferState, notification
from transfer.writes import HeadRoute, Peers, PoolSide, block_runs, write_layers

RANK_EXTENSION = "decode.rank:DecodeRank"  # what a decode worker's ranks 1..n-1 run


class RoundFailed(Exception):
    """A round's WRITEs could not all be posted, or one failed or was late. `wrote`: some
    WRITE was posted and may still land (the destination's blocks stay fenced)."""

    def __init__(self, message: str, wrote: bool) -> None:
        super().__init__(message)
        self.wrote = wrote


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


class Round:
    """The WRITEs of one round: `post()`, then `wait()`, then `release()` (always)."""

    def __init__(self, worker, peers: Peers, legs: list[Leg], dest: Destination, key: str):
        self.worker, self.peers, self.legs, self.dest, self.key = worker, peers, legs, dest, key
        self._mine: list[Transfer] = []
        self._ranks = worker.core.tp_size > 1  # every rank answers, legs or none
        self.posted = False  # some WRITE was posted (it may land whatever happens next)

    def post(self, local: PoolSide, src: np.ndarray, dst: np.ndarray, notify: str | None) -> int:
        """WRITE blocks `src` (of `local` on rank 0, of each rank's pool or staged buffer on
        the others) into the destination's `dst`, every layer; the last round names the
        destination's request in `notify` -> bytes posted."""
        worker, dest = self.worker, self.dest
        layers = worker.core.model_config.num_layers
        notes = [
            notification(notify, dest.fence, k, len(self.legs)) if notify is not None else b""
            for k in range(len(self.legs))
        ]
        blocks = (src, dst, block_runs(src, dst))
        nbytes = 0
        others: dict[int, list[dict]] = {}
        with worker.agent_lock:
            for leg, note in zip(self.legs, notes):
                if leg.rank > 0:
                    others.setdefault(leg.rank, []).append(
                        {
                            "peer_key": (dest.worker_id, leg.dest_rank),
                            "metadata": dest.rank_metadata(leg.dest_rank),
                            "pool": dest.pools[leg.dest_rank],
                            "heads": leg.heads,
                            "notif": note,
                        }
                    )
                    continue
                peer, remote = self.peers.side(
                    (dest.worker_id, leg.dest_rank),
                    dest.rank_metadata(leg.dest_rank),
                    dest.pools[leg.dest_rank],
                )
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
            for answer in worker.core.rank_call(
                "migrate_post", self.key, others, src.tolist(), dst.tolist(), layers
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
            if done and self._ranks:
                polled = worker.core.rank_call("migrate_poll", self.key)
                failed = [p for p in polled if p.startswith("failed")]
                if failed:
                    raise RoundFailed(f"a rank's WRITE {failed[0]}", True)
                done = all(p == "done" for p in polled)
            if done:
                return
            if time.monotonic() > deadline:
                raise RoundFailed("the move was not done by its deadline", True)
            time.sleep(poll_s)

    def release(self, landed: bool) -> None:
        """Every transfer of the round released; `landed`: nothing of it is in flight."""
        worker = self.worker
        with worker.agent_lock:
            for xfer in self._mine:
                xfer.release()
        self._mine = []
        if self._ranks:
            worker.core.rank_call("migrate_release", self.key, landed)
