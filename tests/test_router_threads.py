"""The router's two background duties on a virtual clock: the stream watch cancels what a
silent worker serves (and nothing else), the lease keeper renews what it holds (and stops
when dropped)."""

from __future__ import annotations

from pdserve.router.config import RouterConfig
from pdserve.router.leases import LeaseKeeper
from pdserve.router.registry import WorkerRecord, WorkerRegistry
from pdserve.router.watch import StreamWatch
from pdserve.serving.registration import WorkerStats


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


class Call:
    cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1


class Done:
    def result(self):
        return None


class Method:
    def __init__(self, log: list) -> None:
        self.log = log

    def future(self, request, timeout):
        self.log.append((request.request_id, request.fence, request.lease_s))
        return Done()


class Stub:
    def __init__(self) -> None:
        self.renewed: list[tuple[str, int, float]] = []
        self.Renew = Method(self.renewed)


def registry_with(*ids: str):
    clock = Clock()
    stubs = {}

    def connect(record):
        stubs[record.worker_id] = Stub()
        return None, stubs[record.worker_id]

    registry = WorkerRegistry(RouterConfig(max_model_len=64), clock=clock, connect=connect)
    for wid in ids:
        registry.upsert(WorkerRecord(wid, "decode", f"{wid}:1", "", WorkerStats(8, 8)))
    workers = {w.worker_id: w for w in registry.alive("decode")}
    return registry, clock, workers, stubs


def test_only_the_streams_of_a_silent_worker_are_cancelled_once():
    registry, clock, workers, _ = registry_with("a", "b")
    watch = StreamWatch(registry, period_s=3600)  # ticks by hand here
    try:
        on_a, on_b = Call(), Call()
        wa, wb = watch.add(workers["a"], on_a), watch.add(workers["b"], on_b)
        clock.t = 4.9  # inside the 5 s window (5 missed heartbeats of 1 s)
        assert watch.check() == 0
        registry.upsert(workers["b"].record)  # b heartbeats, a does not
        clock.t = 5.1
        assert watch.check() == 1 and watch.check() == 0
        assert (on_a.cancelled, wa.lost, on_b.cancelled, wb.lost) == (1, True, 0, False)
        watch.remove(wb)
        clock.t = 100.0
        assert watch.check() == 0  # b's stream ended: no longer watched
    finally:
        watch.close()


def test_held_leases_are_renewed_with_their_token_until_dropped():
    registry, _, workers, stubs = registry_with("a")
    keeper = LeaseKeeper(lease_s=3600)  # ticks by hand here
    try:
        lease = keeper.hold(workers["a"], "r~r1", 7)
        keeper.renew_all()
        keeper.renew_all()
        assert stubs["a"].renewed == [("r~r1", 7, 3600.0)] * 2
        keeper.drop(lease)
        keeper.renew_all()
        assert len(stubs["a"].renewed) == 2 and len(keeper) == 0
    finally:
        keeper.close()


def test_a_frozen_worker_is_not_asked_and_a_failing_round_does_not_stop_the_next():
    import threading

    from pdserve.router.periodic import Periodic

    registry, clock, workers, stubs = registry_with("ok", "frozen")
    frozen = workers["frozen"]
    keeper = LeaseKeeper(lease_s=3600, skip=lambda w: w is frozen)
    try:
        keeper.hold(workers["ok"], "a", 1)
        keeper.hold(frozen, "b", 2)
        assert keeper.renew_all() == 1
        assert stubs["ok"].renewed == [("a", 1, 3600.0)] and stubs["frozen"].renewed == []
    finally:
        keeper.close()
    rounds, again = [], threading.Event()

    def tick():
        rounds.append(1)
        if len(rounds) == 1:
            raise RuntimeError("one bad round")
        again.set()

    ticker = Periodic("t", 0.01, tick)
    try:
        assert again.wait(5), "the thread died with its first round"
    finally:
        ticker.close()
