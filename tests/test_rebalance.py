"""The rebalancer's choices on its own (exact expectations): which decode worker gives a
request, which one takes it, which request moves, and the rate limits that keep it from
thrashing. The moves themselves are recorded, not made (tests/test_drain.py makes them)."""

from __future__ import annotations

from test_router import record

from pdserve.router.config import RouterConfig
from pdserve.router.handoff import Inflight
from pdserve.router.migrate import Moved
from pdserve.router.rebalance import Rebalancer
from pdserve.router.registry import WorkerRegistry
from pdserve.router.request import Arrival, Run
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.sim.migrate import SimHandoff  # the two things the rebalancer reads of a Handoff

CONFIG = RouterConfig(
    max_model_len=4096, missed_heartbeats=60, migrate_policy="pressure", migrate_interval_s=2.0
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Mover:
    def __init__(self, blocks: int = 0) -> None:
        self.moves: list[tuple[str, str]] = []
        self.blocks = blocks  # what each move says it reserved (0: not known)

    def move(self, entry: Inflight, dest) -> Moved:
        self.moves.append((entry.run.arrival.request_id, dest.worker_id))
        entry.worker = dest  # what the stream's switch does
        return Moved(True, blocks=self.blocks)


def streaming(handoff: SimHandoff, worker, rid: str, prompt: int, sent: int, max_tokens: int):
    arrival = Arrival(rid, [1] * prompt, pb.SamplingParams(max_tokens=max_tokens), 0.0, 0.0)
    entry = Inflight(worker=worker, worker_request_id=rid, run=Run(arrival, [2] * sent))
    entry.streaming = True
    handoff.inflight[rid] = entry
    return entry


def setup(free_a: int, free_b: int, headroom_a: int = 0, **stats_a):
    clock = Clock()
    reg = WorkerRegistry(CONFIG, clock=clock, connect=lambda r: (None, None))
    reg.upsert(record("a", "decode", free_blocks=free_a, headroom_blocks=headroom_a, **stats_a))
    reg.upsert(record("b", "decode", free_blocks=free_b))
    handoff, mover = SimHandoff(), Mover()
    workers = {w.worker_id: w for w in reg.alive("decode")}
    return clock, reg, handoff, mover, Rebalancer(CONFIG, reg, handoff, mover, clock), workers


def test_a_pressed_worker_gives_the_request_that_relieves_it_most_per_byte():
    clock, reg, handoff, mover, rb, w = setup(free_a=4, free_b=60)  # a: 6% free
    streaming(handoff, w["a"], "long-context", prompt=900, sent=10, max_tokens=100)
    streaming(handoff, w["a"], "much-to-come", prompt=50, sent=10, max_tokens=900)
    streaming(handoff, w["b"], "elsewhere", prompt=50, sent=10, max_tokens=900)
    assert rb.tick()
    assert mover.moves == [("much-to-come", "b")]  # 890 tokens to come per 60 of context


def test_no_move_without_pressure_or_without_a_much_freer_receiver():
    _, _, handoff, mover, rb, w = setup(free_a=20, free_b=60)  # a: 31% free, not pressed
    streaming(handoff, w["a"], "r", prompt=50, sent=10, max_tokens=900)
    assert not rb.tick()
    _, _, handoff, mover, rb, w = setup(free_a=4, free_b=16)  # b is only 19% freer
    streaming(handoff, w["a"], "r", prompt=50, sent=10, max_tokens=900)
    assert not rb.tick() and mover.moves == []


def test_negative_projected_headroom_is_pressure_too():
    _, _, handoff, mover, rb, w = setup(free_a=30, free_b=62, headroom_a=-3)
    streaming(handoff, w["a"], "r", prompt=50, sent=10, max_tokens=900)
    assert rb.tick() and mover.moves == [("r", "b")]


def test_a_worker_projected_short_is_pressure_whatever_its_admission_policy():
    """Greedy admission reports its free blocks as headroom, never negative; the heartbeat's
    projection (its requests grown by the output it expects) says it will run out: a
    worker half free but projected 10 blocks short gives; one projected to fit does not,
    nor one whose projection is not reported (an older decode worker)."""
    _, _, handoff, mover, rb, w = setup(free_a=32, free_b=64, projected_free_blocks=-10)
    streaming(handoff, w["a"], "r", prompt=50, sent=10, max_tokens=900)
    assert rb.tick() and mover.moves == [("r", "b")]
    for projected in (0, None):
        _, _, handoff, mover, rb, w = setup(free_a=32, free_b=64, projected_free_blocks=projected)
        streaming(handoff, w["a"], "r", prompt=50, sent=10, max_tokens=900)
        assert not rb.tick() and mover.moves == []


def test_what_this_router_reserved_since_the_heartbeat_counts_against_the_projection():
    _, reg, handoff, mover, rb, w = setup(free_a=32, free_b=64, projected_free_blocks=3)
    streaming(handoff, w["a"], "r", prompt=50, sent=10, max_tokens=900)
    reg.reserved(w["a"], 2)
    assert not rb.tick()  # 1 block to spare
    reg.reserved(w["a"], 2)
    assert rb.tick() and mover.moves == [("r", "b")]


def test_requests_waiting_after_a_preemption_are_pressure_and_parked_ones_move_first():
    """30 of 64 blocks free is no pressure by itself, but two requests wait there after a
    preemption: the parked ones (as the heartbeat names them, longest parked first) move
    before the one that would relieve the most per byte."""
    _, _, handoff, mover, rb, w = setup(
        free_a=30, free_b=62, preempted=2, parked=("parked-2", "parked-1")
    )
    streaming(handoff, w["a"], "much-to-come", prompt=50, sent=10, max_tokens=900)
    streaming(handoff, w["a"], "parked-1", prompt=50, sent=10, max_tokens=100)
    streaming(handoff, w["a"], "parked-2", prompt=500, sent=10, max_tokens=100)
    assert [e.worker_request_id for e in rb.pick(w["a"])] == [
        "parked-2",
        "parked-1",
        "much-to-come",
    ]
    assert rb.tick() and mover.moves == [("parked-2", "b")]


def test_one_request_per_donor_per_interval():
    clock, _, handoff, mover, rb, w = setup(free_a=4, free_b=60)
    streaming(handoff, w["a"], "r1", prompt=50, sent=10, max_tokens=900)
    streaming(handoff, w["a"], "r2", prompt=50, sent=10, max_tokens=800)
    assert rb.tick()
    assert not rb.tick()  # the same donor within the interval
    clock.t += 2.5
    assert rb.tick()
    assert mover.moves == [("r1", "b"), ("r2", "b")]


def test_a_moved_request_does_not_move_back_within_the_interval():
    clock, reg, handoff, mover, rb, w = setup(free_a=4, free_b=60)
    streaming(handoff, w["a"], "r", prompt=50, sent=10, max_tokens=900)
    assert rb.tick()
    reg.upsert(record("a", "decode", free_blocks=60))  # now b is the pressed one
    reg.upsert(record("b", "decode", free_blocks=4))
    clock.t += 1.0
    assert not rb.tick()
    clock.t += 1.5
    assert rb.tick()
    assert mover.moves == [("r", "b"), ("r", "a")]


def test_requests_not_streaming_or_already_moving_are_left_alone():
    _, _, handoff, mover, rb, w = setup(free_a=4, free_b=60)
    prefilling = streaming(handoff, w["a"], "p", prompt=50, sent=0, max_tokens=900)
    prefilling.streaming = False
    moving = streaming(handoff, w["a"], "m", prompt=50, sent=10, max_tokens=900)
    moving.handover = object()
    assert not rb.tick() and mover.moves == []


def test_a_refused_move_tries_the_next_request_of_the_same_donor():
    """The router cannot see which of a worker's requests run right now: one preempted
    there (its KV dropped) refuses to move, and the next one is tried in the same round."""
    _, _, handoff, mover, rb, w = setup(free_a=4, free_b=60)
    streaming(handoff, w["a"], "preempted", prompt=50, sent=10, max_tokens=900)
    streaming(handoff, w["a"], "running", prompt=50, sent=10, max_tokens=800)
    refused = {"preempted"}
    move = mover.move

    def refusing(entry, dest):
        if entry.run.arrival.request_id in refused:
            mover.moves.append((entry.run.arrival.request_id, "refused"))
            return Moved(False, "not running")
        return move(entry, dest)

    mover.move = refusing
    assert rb.tick()
    assert mover.moves == [("preempted", "refused"), ("running", "b")]


def test_a_burst_on_one_worker_is_spread_in_one_round_until_the_two_are_within_the_gap():
    """a: 4 of 64 free, b: 64 of 64; each move takes 8 blocks (0.125 of a pool) from a to b.
    Gaps after 1, 2, 3 moves: 0.6875, 0.4375, 0.1875 (< 0.25): three moves, then the round
    ends; the next round waits for the interval and fresh heartbeats."""
    clock, reg, handoff, _, _, w = setup(free_a=4, free_b=64)
    mover = Mover(blocks=8)
    rb = Rebalancer(CONFIG, reg, handoff, mover, clock)
    for i in range(6):
        streaming(handoff, w["a"], f"r{i}", prompt=50, sent=10, max_tokens=900 - i)
    assert rb.tick()
    assert mover.moves == [("r0", "b"), ("r1", "b"), ("r2", "b")]
    assert not rb.tick()  # the same donor within the interval


def test_a_round_moves_at_most_its_cap():
    clock, reg, handoff, _, _, w = setup(free_a=0, free_b=64)
    mover = Mover(blocks=1)  # small moves: the gap would allow many more
    rb = Rebalancer(CONFIG, reg, handoff, mover, clock)
    for i in range(12):
        streaming(handoff, w["a"], f"r{i}", prompt=50, sent=10, max_tokens=900 - i)
    assert rb.tick()
    assert len(mover.moves) == Rebalancer.MOVES_PER_ROUND
