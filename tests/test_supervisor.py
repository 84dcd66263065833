"""pdserve launch's Supervisor: exact restart times under backoff, on a fake clock and fake
processes (the real restart of a SIGKILLed worker is in tests/test_cluster.py)."""

from __future__ import annotations

from pdserve.launch import Supervisor


class FakeProc:
    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


class FakeCluster:
    def __init__(self, n: int) -> None:
        self.procs = [FakeProc() for _ in range(n)]
        self.names = [f"p-{i}" for i in range(n)]
        self.restarted: list[tuple[float, int]] = []
        self.now = 0.0
        self.fail_next_start = False

    def restart(self, i: int) -> None:
        if self.fail_next_start:
            self.fail_next_start = False
            raise RuntimeError("failed to start")
        self.procs[i] = FakeProc()
        self.restarted.append((self.now, i))


def run(cluster: FakeCluster, supervisor: Supervisor, until: float, crash_at=()) -> None:
    """Steps every 0.5 s; process 1 dies at each time in crash_at (if running)."""
    crashes = list(crash_at)
    while cluster.now <= until:
        if crashes and cluster.now >= crashes[0]:
            crashes.pop(0)
            cluster.procs[1].code = -9
        supervisor.step()
        cluster.now += 0.5


def test_restarts_at_once_then_back_off_and_start_over_after_a_healthy_run():
    cluster = FakeCluster(3)
    lines: list[str] = []
    supervisor = Supervisor(
        cluster, max_backoff_s=4, healthy_s=60, clock=lambda: cluster.now, log=lines.append
    )
    # dies at 10, then again right after each restart: at once, +1, +2, +4, +4 (capped)
    run(cluster, supervisor, until=40, crash_at=[10, 10.5, 12, 14.5, 19, 23.5])
    assert [t for t, i in cluster.restarted] == [10, 11.5, 14, 18.5, 23, 27.5]
    assert {i for _, i in cluster.restarted} == {1}  # the others were never touched
    assert supervisor.restarts == 6
    # up for longer than healthy_s: the next exit is restarted at once again
    run(cluster, supervisor, until=100, crash_at=[95])
    assert cluster.restarted[-1] == (95, 1)
    assert "p-1 exited (-9); restarting it in 0 s" in lines


def test_a_restart_that_fails_to_start_is_tried_again_later():
    cluster = FakeCluster(2)
    supervisor = Supervisor(cluster, clock=lambda: cluster.now, log=lambda _: None)
    cluster.fail_next_start = True
    run(cluster, supervisor, until=5, crash_at=[1])
    # failed to start at 1, seen dead again at 1.5, retried 1 s later
    assert [t for t, _ in cluster.restarted] == [2.5]
