"""When to migrate: the router's rebalancer (`--migrate-policy pressure`; off by default).

Every `rebalance_period_s` it looks at the decode workers' last heartbeats (and the blocks
this router reserved on them since):

    donor       the one with the least free KV, when under `migrate_low_free` of its pool
                is free, it is projected short (its requests, grown by the output it
                expects of each, would not fit its pool: it will preempt unless some
                leave; whatever its admission policy), its admission policy projects
                negative headroom, or requests wait there after a preemption (parked in a
                tier, or to be computed again)
    receiver    the one with the most free KV, at least `migrate_min_gap` of a pool freer
                than the donor (so that a move never makes the receiver the next donor:
                no thrashing back and forth)
    request     of the donor's streaming requests, a parked one first (longest parked
                first: it makes no progress where it is, and moves from its tier in one
                round), then the one whose move frees the most pressure per byte moved: the
                most tokens still to come (the growth the donor is spared) per token of
                context (the KV the move copies)

and moves that request (pdserve/router/migrate.py), then the next one, until the two are
within `migrate_min_gap` of each other counting the blocks moved (at most MOVES_PER_ROUND):
a burst that landed on one worker is spread in one round. Rate limits: a donor gives in at
most one round per `migrate_interval_s`, and a request that moved once is not moved again
within `migrate_interval_s` either; the gap rule, checked after every move, keeps a round
from making the receiver the next donor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pdserve.router.config import RouterConfig
from pdserve.router.handoff import Handoff, Inflight
from pdserve.router.migrate import Mover
from pdserve.router.registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)

POLICIES = ("off", "pressure")


def free_fraction(worker: Worker) -> float:
    """Free blocks over the pool, less what this router reserved since the heartbeat."""
    s = worker.record.stats
    if s.total_blocks <= 0:
        return 0.0
    return max(0, s.free_blocks - worker.pending_blocks) / s.total_blocks


def projected_short(worker: Worker) -> bool:
    """Its heartbeat projects its requests' growth past its pool (less what this router
    reserved on it since)."""
    projected = worker.record.stats.projected_free_blocks
    return projected is not None and projected - worker.pending_blocks < 0


def relief_per_byte(entry: Inflight) -> float:
    """Tokens the request may still generate per token of KV it holds now."""
    run = entry.run
    context = len(run.arrival.prompt) + len(run.tokens)
    left = run.arrival.sampling.max_tokens - len(run.tokens)
    return left / max(1, context)


class Rebalancer:
    TRIES = 4  # refusals per round: the router cannot see which requests run right now
    MOVES_PER_ROUND = 8

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        handoff: Handoff,
        mover: Mover,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.registry, self.handoff, self.mover = config, registry, handoff, mover
        self.clock = clock
        self._last_gave: dict[str, float] = {}  # donor worker id -> when it last gave one
        self._moved_at: dict[int, float] = {}  # id(entry) -> when it last moved

    def pair(self) -> tuple[Worker, Worker] | None:
        """(donor, receiver) when one should give a request to the other now."""
        workers = self.registry.routable("decode")
        if len(workers) < 2:
            return None
        donor = min(workers, key=free_fraction)
        receiver = max(workers, key=free_fraction)
        stats = donor.record.stats
        pressed = (
            free_fraction(donor) < self.config.migrate_low_free
            or projected_short(donor)
            or stats.headroom_blocks < 0
            or stats.preempted > 0
        )
        if not pressed or donor is receiver:
            return None
        if free_fraction(receiver) - free_fraction(donor) < self.config.migrate_min_gap:
            return None
        if (
            self.clock() - self._last_gave.get(donor.worker_id, -1e18)
            < self.config.migrate_interval_s
        ):
            return None
        return donor, receiver

    def pick(self, donor: Worker) -> list[Inflight]:
        """The donor's streaming requests: its parked ones (as its last heartbeat named
        them) first, then the one whose move relieves it most per byte moved first."""
        now = self.clock()
        with self.handoff.lock:
            candidates = [
                e
                for e in self.handoff.inflight.values()
                if e.worker is donor
                and e.streaming
                and e.handover is None
                and e.run is not None
                and now - self._moved_at.get(id(e), -1e18) >= self.config.migrate_interval_s
            ]
        parked = {rid: i for i, rid in enumerate(donor.record.stats.parked)}
        last = len(parked)
        return sorted(
            candidates,
            key=lambda e: (parked.get(e.worker_request_id, last), -relief_per_byte(e)),
        )

    def tick(self) -> bool:
        """One round -> whether a request moved. A round moves requests off the donor until
        the two are within `migrate_min_gap` of each other (each move counted at the blocks
        the receiver reserved for it; a move of unknown size ends the round), at most
        MOVES_PER_ROUND, so that a burst on one worker is spread in one round, not one
        request per `migrate_interval_s` while the donor preempts."""
        paired = self.pair()
        if paired is None:
            return False
        donor, receiver = paired
        tries = self.pick(donor)
        if not tries:
            return False
        t = self.clock()
        interval = self.config.migrate_interval_s  # older entries decide nothing: dropped
        self._last_gave = {w: at for w, at in self._last_gave.items() if t - at < interval}
        self._last_gave[donor.worker_id] = t
        moved = failed = shifted = 0
        for entry in tries:  # a request preempted there (no KV to move) refuses: the next
            if failed >= self.TRIES or moved >= self.MOVES_PER_ROUND:
                break
            result = self.mover.move(entry, receiver)
            if not result.ok:
                failed += 1
                continue
            self._moved_at[id(entry)] = self.clock()
            log.info("moved a request from %s to %s", donor.worker_id, receiver.worker_id)
            moved += 1
            if result.blocks <= 0:
                break
            shifted += result.blocks
            if self._gap_after(donor, receiver, shifted) < self.config.migrate_min_gap:
                break
        self._forget_ended()
        return moved > 0

    @staticmethod
    def _gap_after(donor: Worker, receiver: Worker, shifted: int) -> float:
        """The receiver's free fraction less the donor's once `shifted` blocks moved."""
        d, r = donor.record.stats, receiver.record.stats
        donor_free = free_fraction(donor) + shifted / max(1, d.total_blocks)
        receiver_free = free_fraction(receiver) - shifted / max(1, r.total_blocks)
        return receiver_free - donor_free

    def _forget_ended(self) -> None:
        with self.handoff.lock:
            live = {id(e) for e in self.handoff.inflight.values()}
        for key in [k for k in self._moved_at if k not in live]:
            del self._moved_at[key]
