"""Live migration, the side a request leaves: its KV moves into blocks another decode worker
reserved for it (the router's Reserve there, with room to grow), while it keeps decoding.

    round 1..n-1   WRITE every block written since the previous round (the first: all of
                   them, after the ones the destination holds already); the request decodes
                   on meanwhile, so its last block (partial, still being written) goes again
    last round     once at most `migrate_final_blocks` blocks changed since the previous
                   round (or at `migrate_max_rounds`, or before the request outgrows the
                   destination's blocks): stop the request at a step boundary (detached
                   from the engine with its blocks), WRITE what changed since, notify
    then           its blocks come back here and its stream ends "migrated": the router
                   starts it on the destination with the tokens it was sent

While it moves, the request's KV may not grow past the destination's blocks (the engine
holds it there, not scheduled, until the last round stops it: core.hold()): a fast decoder
can outrun a slow pre-copy round, and then waiting a round beats a move that must fail.

A parked request (preempted, its KV in a spill tier) moves in one round: taken out of the
parked queue, its KV unpacked from the tier into a staging buffer registered with the agent
for the move, WRITTEN from there, and dropped from the tier once it landed; a failed move
parks it again (or, when its KV was lost on the way, it is computed again here).

Full blocks never change again (a sequence only appends; a block shared by prefix caching
is copied before it is written), so what a round moved stays true unless the request was
preempted meanwhile (its blocks dropped or parked): then the move fails and the request
goes on here. A move that fails at any point before the request stopped leaves it running
here untouched; one whose last round fails runs here again (admitted back with its blocks).
Either way the destination's reservation is the router's to release (its blocks stay fenced
until the push window is over, decode/reservations.py), so there is never a second owner.

A tensor-parallel worker moves one leg per pair of ranks (decode/legs.py): rank 0 posts its
own, ranks 1..n-1 theirs when told (decode/rank.py), each its own KV heads; a parked
request's shard is staged by each sending rank from its own tier.

Every call on the transfer agent is made under the worker's agent lock, never under its
main lock: adding a peer and its first WRITE can take 100 ms (a connection is made), and
the step loop must not wait for that (it skips collecting notifications while the agent
is busy; decode/worker.py). Ranks 1..n-1 add their peers before the request stops; their
posts and polls run between two steps of theirs, so a step may wait behind one (a post
is quick once connected).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from decode.legs import (
    Leg,
    Round,
    RoundFailed,
    connect,
    plan_legs,
    release_ranks,
    stage_ranks,
)
from pdserve.serving.destination import Destination
from pdserve.serving.kv_pool import pool_geometry
from pdserve.trace import Span, now
from transfer import HandshakeRefused, Transfer
from transfer.retiring import Retiring
from transfer.writes import Peers, PoolSide, pool_side


class MigrationFailed(RuntimeError):
    """The request was not moved and goes on here (or ended). `wrote`: a WRITE into the
    destination may still be in flight (its blocks must stay fenced: ABORTED at the edge;
    else FAILED_PRECONDITION, and they may go back at once: every WRITE posted before was
    seen complete). `retryable`: a later try may work
    (the transfer failed, or the request was preempted), not when it cannot move at all."""

    def __init__(self, message: str, retryable: bool, wrote: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.wrote = wrote


@dataclass(frozen=True)
class _Move:
    """One move's fixed parts: where to, its legs (one per pair of ranks), its deadline."""

    dest: Destination
    dest_request_id: str
    legs: list[Leg]
    deadline: float  # time.monotonic()

    @property
    def key(self) -> str:  # how the ranks name its rounds
        return self.dest_request_id


@dataclass(frozen=True)
class Migrated:
    rounds: int
    nbytes: int
    num_tokens: int  # the request's tokens when it stopped here (the last one's KV not computed)
    stall_s: float  # stopped here -> its last WRITE complete


class Migrator:
    """The moves out of one decode worker (`worker`: decode/worker.py's DecodeWorker)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.local = pool_side(worker.endpoint.agent, worker.endpoint.layout)
        self.peers = Peers(worker.endpoint.agent)  # keyed (destination worker id, its rank)
        # staging a lost WRITE may still read (swept with the step loop's notifications)
        self.retiring = Retiring(worker.endpoint.agent)

    def move(
        self,
        request_id: str,
        dest: Destination,
        dest_request_id: str,
        max_rounds: int = 0,
        timeout_s: float | None = None,
    ) -> Migrated:
        """Move `request_id` into `dest` (reserved as `dest_request_id`) in at most
        `max_rounds` rounds (0: the configured), done within `timeout_s` (the configured
        one when None or longer) -> what it took. Raises MigrationFailed (the request goes
        on here)."""
        if max_rounds < 0:
            raise ValueError(f"max_rounds: must be >= 0, got {max_rounds}")
        limit = self.worker.config.migrate_timeout_s
        timeout = limit if timeout_s is None else min(limit, timeout_s)
        try:
            return self._move(request_id, dest, dest_request_id, max_rounds, timeout)
        except MigrationFailed:
            with self.worker.lock:
                self.worker.metrics.migrations.labels("failed").inc()
            raise

    def _move(
        self,
        request_id: str,
        dest: Destination,
        dest_request_id: str,
        max_rounds: int,
        timeout_s: float,
    ) -> Migrated:
        worker = self.worker
        with worker.lock:
            if worker.core.computing_context(request_id):  # the destination would decode
                raise MigrationFailed(  # on KV that was never computed
                    f"{request_id!r} is still computing its context here", True
                )
        try:
            legs = plan_legs(worker.endpoint, dest)  # the same model, heads we can map
        except HandshakeRefused as e:
            raise MigrationFailed(f"destination: {e}", False) from None
        try:
            connect(worker, self.peers, legs, dest)  # every rank to the ranks it writes to
        except RoundFailed as e:
            raise MigrationFailed(f"destination {dest.worker_id}: {e}", e.retryable) from None
        move = _Move(dest, dest_request_id, legs, time.monotonic() + timeout_s)
        bs = worker.core.block_size
        with worker.lock:
            parked = worker.core.detach_parked(request_id)
        if parked is not None:
            return self._move_parked(parked, move)
        with worker.lock:  # it waits at the destination's size rather than outgrow it
            worker.core.hold(request_id, len(dest.block_ids) * bs)
        try:
            return self._move_running(request_id, move, max_rounds)
        finally:  # moved (gone from here), or going on here: no bound either way
            with worker.lock:
                worker.core.hold(request_id, None)

    def _move_running(self, request_id: str, move: _Move, max_rounds: int) -> Migrated:
        """Pre-copy rounds while it decodes, then the last with it stopped."""
        bs = self.worker.core.block_size
        sent = move.dest.cached_blocks  # blocks [0, sent) are there and final
        rounds, nbytes, growth = 0, 0, bs
        limit = max_rounds or self.worker.config.migrate_max_rounds
        while True:
            request, blocks, computed = self._next(
                request_id, sent, rounds >= limit - 1, growth, move.dest, move.deadline
            )
            if request is None:  # a pre-copy round: the request decodes on meanwhile
                nbytes += self._write(move, blocks, sent, computed, final=False)
                rounds += 1
                now_computed = self._unmoved(request_id, blocks)
                growth = max(growth, now_computed - computed)
                sent = computed // bs  # the partial last block goes again
                continue
            stopped, stopped_wall = time.monotonic(), now()
            try:
                nbytes += self._write(move, blocks, sent, computed, final=True)
            except Exception:  # whatever failed, the stopped request goes on here
                self._readmit(request)
                raise
            return self._moved(request, rounds + 1, nbytes, stopped, stopped_wall)

    def _move_parked(self, request, move: _Move) -> Migrated:
        """One round from the tier the request is parked in (it does not decode meanwhile):
        its KV unpacked into a staging buffer registered with the agent (on every rank of
        a tensor-parallel worker that sends, each its own shard), WRITTEN from there. When
        some rank's shard is lost, every rank drops the request's KV (the tiers hold all of
        it or none) and it is computed again here."""
        worker = self.worker
        core = worker.core
        rid = request.request_id
        stopped, stopped_wall = time.monotonic(), now()
        landed = False
        try:
            with worker.lock:  # the tiers are the core's: read under its lock
                staging = self._staging(core.parked_blocks(rid))
                try:
                    staged = core.copy_parked(request, staging) and stage_ranks(
                        worker, move.legs, move.key, rid
                    )
                except RoundFailed as e:
                    raise MigrationFailed(str(e), e.retryable) from None
                if not staged:
                    core.drop_parked(request)  # every rank's: computed again when readmitted
                    raise MigrationFailed(f"the parked KV of {rid!r} was lost or corrupt", True)
            blocks = list(range(staging.shape[core.kv_block_dim]))
            computed = request.num_computed_tokens
            with worker.agent_lock:
                region = worker.endpoint.agent.register(staging)
            local = PoolSide(
                pool_geometry(core.model_config, staging, core.kv_block_dim), region, None
            )
            posted: list[Transfer] = []  # a failed round's, handed over unreleased
            try:
                sent = move.dest.cached_blocks
                nbytes = self._write(
                    move, blocks, sent, computed, final=True, local=local, posted=posted
                )
                landed = True
            except MigrationFailed as e:
                landed = not e.wrote  # nothing in flight: the region may go
                raise
            finally:
                with worker.agent_lock:
                    if landed:
                        for xfer in posted:
                            xfer.release()
                        worker.endpoint.agent.deregister(region)
                    else:  # a WRITE may still read it: kept until every one has ended
                        self.retiring.keep(staging, region, posted)
                    worker.metrics.staging_kept.set(self.retiring.nbytes)
        except Exception:
            self._readmit(request)
            raise
        finally:  # whatever the ranks staged goes (the round let it go already, or not)
            release_ranks(worker, move.key, landed)
        return self._moved(request, 1, nbytes, stopped, stopped_wall)

    def _staging(self, num_blocks: int) -> torch.Tensor:
        """A buffer shaped like the pool with `num_blocks` blocks."""
        pool, dim = self.worker.core.kv_pool, self.worker.core.kv_block_dim
        if num_blocks <= 0:
            raise MigrationFailed("its parked KV is gone", True)
        shape = (*pool.shape[:dim], num_blocks, *pool.shape[dim + 1 :])
        return torch.empty(shape, dtype=pool.dtype, device=pool.device)

    def _readmit(self, request) -> None:
        """A stopped request whose move failed goes on here (or ends: aborted meanwhile)."""
        worker = self.worker
        with worker.lock:
            done = worker.core.admit_detached(request)
            if done is not None:
                worker.ended(done)

    def _moved(self, request, rounds: int, nbytes: int, stopped: float, stopped_wall: float):
        worker = self.worker
        stall = time.monotonic() - stopped
        with worker.lock:
            worker.handed_over(
                request, Span("decode.migrate", stopped_wall, now(), worker.worker_id)
            )
            m = worker.metrics
            m.migrations.labels("completed").inc()
            m.migrated_bytes.inc(nbytes)
            m.migration_rounds.observe(rounds)
            m.migration_stall.observe(stall)
        return Migrated(rounds, nbytes, len(request.token_ids), stall)

    def _next(self, request_id: str, sent: int, final: bool, growth: int, dest, deadline: float):
        """The next round (`final`: the last allowed) -> (None, blocks, tokens with KV) for a
        pre-copy round, or (the request detached from the engine at a step boundary, its
        blocks, tokens with KV) for the last."""
        worker = self.worker
        config, bs = worker.config, worker.core.block_size
        capacity = len(dest.block_ids) * bs
        with worker.lock:
            kv = worker.core.kv_of(request_id)
        if kv is None:
            raise MigrationFailed(f"{request_id!r} is not running here", False)
        blocks, computed, longest = kv
        dirty = -(-computed // bs) - sent
        room = capacity - computed - bs  # a block of slack: the stop lands a step or two late
        if longest - 1 <= capacity:  # the blocks hold it whatever it does (the last token
            room = float("inf")  # of a sequence never has KV)
        last = final or dirty <= config.migrate_final_blocks or 2 * growth > room
        if not last:
            return None, blocks, computed
        config.failpoints.hit("decode.migrate", request_id)
        try:
            request = worker.detach(request_id, max(0.0, deadline - time.monotonic()))
        except TimeoutError as e:
            raise MigrationFailed(str(e), True) from None
        if request is None:
            raise MigrationFailed(f"{request_id!r} ended before it could stop here", False)
        return request, list(request.block_ids), request.num_computed_tokens

    def _unmoved(self, request_id: str, blocks: list[int]) -> int:
        """After a pre-copy round: the request's tokens with KV now. Raises MigrationFailed
        when it ended, or was preempted (what moved may no longer be its KV)."""
        with self.worker.lock:
            kv = self.worker.core.kv_of(request_id)
        if kv is None:
            raise MigrationFailed(f"{request_id!r} ended or was preempted while it moved", False)
        now_blocks, computed, _ = kv
        if now_blocks[: len(blocks)] != blocks[: len(now_blocks)]:
            raise MigrationFailed(f"{request_id!r} was preempted while its KV moved", True)
        return computed

    def _write(
        self,
        move: _Move,
        blocks: list[int],
        sent: int,
        computed: int,
        final: bool,
        local: PoolSide | None = None,
        posted: list[Transfer] | None = None,
    ) -> int:
        """WRITE blocks [sent, the one holding token `computed` - 1] of every layer (from
        `local`: our pool when None; the other ranks' pools), with the notifications when
        `final` -> bytes moved. `posted`: the round's WRITEs are of a staged buffer (every
        rank's); when it fails, rank 0's go into `posted` unreleased (they may still read
        it)."""
        staged = posted is not None
        worker, dest = self.worker, move.dest
        upto = -(-computed // worker.core.block_size)
        if upto > len(dest.block_ids):
            raise MigrationFailed(
                f"{computed} tokens outgrew the {len(dest.block_ids)} blocks reserved", True
            )
        if final and sent >= upto:  # nothing changed: the last block carries the notification
            sent = upto - 1
        src = np.asarray(blocks[sent:upto], dtype=np.int64)
        dst = np.asarray(dest.block_ids[sent:upto], dtype=np.int64)
        if src.size == 0 and not final:
            return 0
        round_ = Round(worker, self.peers, move.legs, dest, move.key)
        landed = False
        try:
            nbytes = round_.post(
                self.local if local is None else local,
                src,
                dst,
                move.dest_request_id if final else None,
                staged,
            )
            round_.wait(move.deadline, worker.config.kv_arrival_poll_s)
            landed = True
            return nbytes
        except RoundFailed as e:
            landed = not e.wrote
            raise MigrationFailed(f"the move's {e}", e.retryable, wrote=e.wrote) from None
        finally:
            if staged and not landed:
                posted.extend(round_.take())
            round_.release(landed)
