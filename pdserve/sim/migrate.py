"""Live KV migration in the cluster simulator (`+migrate` policies): the router's own
rebalancer (pdserve/router/rebalance.py) chooses on the simulated heartbeats, and each move
runs the decode workers' real books on the virtual clock, costing what the profile's link
says.

    begin     the destination reserves the context the client has, all but its last token,
              with room to grow (DecodeState.reserve, as the router's Reserve); refused:
              the rebalancer tries its next request
    pre-copy  a running request decodes on at its worker while every block it holds
              crosses the link (bytes / link bytes/s + latency); a parked one skips this
    stop      at the worker's next step boundary the request is detached with its blocks
              (EngineCore.detach, or detach_parked from a tier), and what changed since the
              pre-copy crosses (the blocks it grew, its last partial one)
    start     after the Start's cost (the profile's handoff), the destination decodes on
              with the tokens produced meanwhile; the source's blocks (or parked KV) go back
              (EngineCore.handed_over)

A request that ends, or is preempted to recompute, before its stop is not moved (the
destination's reservation is released). Simplified against the real move: one pre-copy
round, and a parked request's read from its tier is not charged (the link is).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

from decode.state import ReservationError
from pdserve.engine.request import Request
from pdserve.router.config import RouterConfig
from pdserve.router.handoff import Inflight
from pdserve.router.migrate import Moved
from pdserve.router.rebalance import Rebalancer


@dataclass
class SimRun:
    """What the rebalancer reads of a router's Run, over the engine's request."""

    rid: str  # the client's request id (the records' key)
    arrival: SimpleNamespace  # .prompt, .sampling.max_tokens
    request: Request  # on the decode worker serving it now

    @property
    def tokens(self) -> list[int]:
        return self.request.output_token_ids


@dataclass(eq=False)
class SimMove:
    rid: str  # the client's request id (the records' key)
    entry: Inflight
    src: object  # cluster._Decode
    dest: object
    dest_rid: str
    sent: int  # the request's tokens when the destination reserved
    precopied: int  # blocks the pre-copy moved (0: parked, it moves at the stop)


@dataclass
class SimHandoff:
    """The two things the rebalancer reads of the router's Handoff."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    inflight: dict[str, Inflight] = field(default_factory=dict)


class SimMigrations:
    """The cluster simulator's mover: `cluster` is pdserve/sim/cluster.py's ClusterSim."""

    def __init__(self, cluster, config: RouterConfig) -> None:
        self.cluster = cluster
        self.config = config
        self.handoff = SimHandoff()
        self.rebalancer = Rebalancer(config, cluster.registry, self.handoff, self, cluster.clock)
        self.moves = 0
        self._stopping: dict[str, list[SimMove]] = {}  # decode name -> moves to stop there
        self._ids: dict[str, str] = {}  # a moved request's id on a worker -> the client's

    def client_id(self, worker_rid: str) -> str:
        return self._ids.get(worker_rid, worker_rid)

    def streaming(self, rid: str, d, request: Request, prompt: list[int], max_tokens: int):
        """A request started streaming on `d`: the rebalancer may move it from now on."""
        worker = self.cluster.registry.find(d.name, "decode")
        arrival = SimpleNamespace(prompt=prompt, sampling=SimpleNamespace(max_tokens=max_tokens))
        entry = Inflight(worker=worker, worker_request_id=request.request_id)
        entry.run, entry.streaming = SimRun(rid, arrival, request), True
        self.handoff.inflight[rid] = entry

    def ended(self, rid: str) -> None:
        self.handoff.inflight.pop(rid, None)

    # -- the mover the rebalancer calls ---------------------------------------------------
    def move(self, entry: Inflight, dest_worker) -> Moved:
        c = self.cluster
        now = c.clock.now
        src = c.decode_named(entry.worker.worker_id)
        dest = c.decode_named(dest_worker.worker_id)
        req = entry.run.request
        running = src.engine.core.kv_of(req.request_id) is not None
        if not (running or src.engine.core.kv.is_parked(req.request_id)):
            return Moved(False, "not running or parked")
        if src.engine.core.computing_context(req.request_id):  # as decode/migrate.py refuses
            return Moved(False, "still computing its context")
        # every token but its last (whose KV is not computed), to the same total length
        context = req.token_ids[:-1]
        left = req.max_total_tokens - len(context)
        # the same request (a hidden length keeps its position in the sequence) with the
        # tokens it has left
        params = dataclasses.replace(req.params, max_tokens=left)
        dest_rid = f"{req.request_id}~m"
        dest.engine.clock.now = max(dest.engine.clock.now, now)
        try:
            reserved = dest.state.reserve(
                dest_rid,
                context,
                params,
                push_window_s=self.config.migrate_timeout_s + self.config.push_margin_s,
                extra_tokens=min(self.config.migrate_extra_tokens, left),
                # its output so far, but the last token (the context ends before it)
                generated=req.output_length - 1,
            )
        except (ReservationError, ValueError) as e:
            return Moved(False, str(e))
        precopied = len(req.block_ids) if running else 0  # running: it decodes on meanwhile
        move = SimMove(entry.run.rid, entry, src, dest, dest_rid, len(req.token_ids), precopied)
        entry.handover = move  # not picked again while it moves
        pre_copy = self._link(precopied) if precopied else 0.0
        c.at(now + c.profile.handoff.reserve_s + pre_copy, "migrate-stop", move)
        return Moved(True, blocks=len(reserved.block_ids))

    def _link(self, blocks: int) -> float:
        link = self.cluster.profile.link
        return link.latency_s + blocks * self.cluster.block_bytes / link.bytes_s

    # -- the move's events ------------------------------------------------------------------
    def stop(self, now: float, move: SimMove) -> None:
        """The stop, at the source's step boundary (deferred while a step runs)."""
        if move.src.busy:
            self._stopping.setdefault(move.src.name, []).append(move)
            return
        core = move.src.engine.core
        rid = move.entry.run.request.request_id
        if (detached := core.detach(rid)) is not None:  # what changed since the pre-copy
            blocks = max(1, len(detached.block_ids) - move.precopied + 1)
        elif (detached := core.detach_parked(rid)) is not None:  # all of it, from its tier
            blocks = core.parked_blocks(rid)
        else:  # ended, or waits to be computed again: nothing to move
            self._abandon(move)
            return
        self.cluster.at(
            now + self._link(blocks) + self.cluster.profile.handoff.start_s,
            "migrate-start",
            move,
            detached,
        )

    def step_boundary(self, now: float, d) -> None:
        """`d`'s step ended: the stops that waited for it."""
        for move in self._stopping.pop(d.name, []):
            self.stop(now, move)

    def start(self, now: float, move: SimMove, detached: Request) -> None:
        c = self.cluster
        move.src.engine.core.handed_over(detached)
        tokens = detached.token_ids
        dest = move.dest
        dest.engine.clock.now = max(dest.engine.clock.now, now)
        res, done = dest.state.start(move.dest_rid, tokens[-1], tokens[move.sent - 1 : -1])
        self._ids[move.dest_rid] = move.rid
        self.moves += 1
        entry = move.entry
        entry.handover = None
        entry.worker = c.registry.find(dest.name, "decode")
        entry.worker_request_id = move.dest_rid
        entry.run.request = res.request
        c.moved(now, move.rid, dest, done, detached.num_output_tokens)
        c.kick(now, move.src)

    def _abandon(self, move: SimMove) -> None:
        move.dest.state.release(move.dest_rid, unpushed=True)
        move.entry.handover = None
