"""Faults on the live-migration path, in a launched 1P2D cluster (real processes, NIXL on
127.0.0.1): a drain moves the busier decode worker's streams while the worker they leave (A)
is killed or frozen at the move's last round, the worker they go to (B) is killed mid-move
or frozen past its reservation's lease, or the client cancels mid-move (the `decode.migrate`
failpoint: exact states, not guessed moments). Every other request completes with the
colocated engine's tokens, none lost or repeated, and the survivors hold no block
afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
from long_streams import PROMPTS, all_free, busiest_decode, colocated, drain_rpc, streams

from pdserve import failpoints
from pdserve.bench.probes import pid_of, registered
from pdserve.bench.prometheus import scrape, total
from pdserve.client import Client
from pdserve.launch import Cluster
from pdserve.rpc import pdserve_pb2 as pb


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return colocated()


def cluster(points: str, *router_args: str, decode_tp: int = 1) -> Cluster:
    return Cluster(
        "tiny-llama",
        1,
        2,
        decode_tp=decode_tp,
        worker_args=["--num-kv-blocks", "512"],
        # greedy admission: when one decode worker is left it takes every stream (its
        # pool holds them all at full length), none waits out the router's queue timeout
        decode_args=["--failpoints", points, "--admission", "greedy"],
        # a failed move's destination blocks stay fenced for its window: short here
        router_args=["--migrate-timeout", "5", *router_args],
    )


def drain_busiest(c: Cluster) -> tuple[str, str, list[pb.DrainProgress]]:
    """Drain the decode worker running the most streams -> (its id, the other's, progress)."""
    wid = busiest_decode(c)
    other = next(w for w, n in registered(c).items() if n.startswith("decode") and w != wid)
    return wid, other, drain_rpc(c, wid)


def other_decode(c: Cluster, pid: int) -> int:
    """The pid of the decode worker that is not `pid`."""
    decodes = [p.pid for n, p in zip(c.names, c.procs) if n.startswith("decode")]
    return next(p for p in decodes if p != pid)


def on_fire(points: str, action) -> threading.Thread:
    """Run `action(pid, detail)` once decode.migrate fires (from a thread); the streams'
    slow steps (long_streams.streams) end with it: the move under test has come."""

    def watch() -> None:
        deadline = time.monotonic() + 120
        while (hit := failpoints.fired(points, "any", "decode.migrate")) is None:
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)
        action(*hit)
        failpoints.disarm(points, "any", "decode.step")

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_the_worker_a_request_leaves_dies_at_the_last_round(expected, tmp_path):
    points = str(tmp_path)
    with cluster(points) as c, Client(c.address, security=c.security) as client:
        worker_of = {pid_of(c, name): wid for wid, name in registered(c).items()}
        failpoints.arm(points, "any", "decode.migrate", "kill")
        results, (drained, other, progress) = streams(client, lambda: drain_busiest(c), slow=points)
        hit = failpoints.fired(points, "any", "decode.migrate")
        assert hit is not None and worker_of[hit[0]] == drained  # the one it left died
        assert progress[-1].done  # its streams resumed elsewhere: none left on it
        for (tokens, (_, reason)), want in zip(results, expected):
            assert tokens == want and reason == "length"  # none lost, none repeated
        assert sum(t["resumes"] for _, (t, _) in results) >= 1  # its streams, by recompute
        assert all(t["decode_worker"] == other for _, (t, _) in results if t["resumes"])
        all_free(client, dead={drained})


def test_the_worker_a_request_goes_to_dies_mid_move(expected, tmp_path):
    """A holds the move's last round for a second while B is SIGKILLed: A's WRITE into B
    fails and the request decodes on at A, nothing recomputed."""
    points = str(tmp_path)
    with cluster(points) as c, Client(c.address, security=c.security) as client:
        failpoints.arm(points, "any", "decode.migrate", "pause 1")
        struck: list[int] = []

        def kill_the_other(pid: int, detail: str) -> None:
            victim = other_decode(c, pid)
            os.kill(victim, signal.SIGKILL)
            struck.append(victim)

        watcher = on_fire(points, kill_the_other)
        results, (drained, other, _) = streams(client, lambda: drain_busiest(c), slow=points)
        watcher.join(timeout=5)
        assert struck, "decode.migrate never fired"
        for (tokens, (_, reason)), want in zip(results, expected):
            assert tokens == want and reason == "length"
        on_a = [t for _, (t, _) in results if t["decode_worker"] == drained]
        assert on_a and all(t["migrations"] == 0 for t in on_a)
        router = scrape(c.metrics["router-0"])
        assert total(router, "pdserve_router_migrations_total", outcome="failed") >= 1
        all_free(client, dead={other})


def test_a_rank_of_the_tensor_parallel_worker_a_request_goes_to_dies_mid_move(expected, tmp_path):
    """Both decode workers are TP=2 groups. A holds the move's last round for a second
    while rank 1 of B is SIGKILLed: B's group fails and B leaves service (exit 70), A's
    last WRITEs into B fail, and the request decodes on at A with every rank's KV intact
    (B's own streams resume at A); every token equal, nothing held by A afterwards."""
    points = str(tmp_path)
    with (
        cluster(points, decode_tp=2) as c,
        Client(c.address, security=c.security) as client,
    ):
        failpoints.arm(points, "any", "decode.migrate", "pause 1")
        struck: list[int] = []

        def kill_a_rank_of_the_other(pid: int, detail: str) -> None:
            victim = other_decode(c, pid)
            (rank1,) = subprocess.run(
                ["pgrep", "-P", str(victim)], capture_output=True, text=True
            ).stdout.split()
            os.kill(int(rank1), signal.SIGKILL)
            struck.append(victim)

        watcher = on_fire(points, kill_a_rank_of_the_other)
        results, (drained, other, _) = streams(client, lambda: drain_busiest(c), slow=points)
        watcher.join(timeout=5)
        assert struck, "decode.migrate never fired"
        b = c.procs[[p.pid for p in c.procs].index(struck[0])]
        assert b.wait(30) == 70  # its group failed: out of service, and says why
        for (tokens, (_, reason)), want in zip(results, expected):
            assert tokens == want and reason == "length"
        on_a = [t for _, (t, _) in results if t["decode_worker"] == drained]
        assert on_a and all(t["migrations"] == 0 for t in on_a)  # B's own streams resumed
        router = scrape(c.metrics["router-0"])
        assert total(router, "pdserve_router_migrations_total", outcome="failed") >= 1
        all_free(client, dead={other})


def test_a_request_cancelled_mid_move_leaves_nothing_held(expected, tmp_path):
    points = str(tmp_path)
    with cluster(points) as c, Client(c.address, security=c.security) as client:
        failpoints.arm(points, "any", "decode.migrate", "pause 1")
        cancelled: list[str] = []

        def cancel(pid: int, detail: str) -> None:
            rid = detail.strip().split("~")[0]
            assert client.abort(rid)
            cancelled.append(rid)

        watcher = on_fire(points, cancel)
        results, _ = streams(client, lambda: drain_busiest(c), slow=points)
        watcher.join(timeout=5)
        assert len(cancelled) == 1
        reasons = [reason for _, (_, reason) in results]
        assert reasons.count("abort") == 1
        for (tokens, (_, reason)), want in zip(results, expected):
            if reason != "abort":
                assert tokens == want and reason == "length"
            else:
                assert tokens == want[: len(tokens)]  # a prefix: nothing wrong was sent
        all_free(client)


def test_the_worker_a_request_leaves_freezes_at_the_last_round(expected, tmp_path):
    """A SIGSTOPs itself as it would stop the request: the router's Migrate times out (the
    move failed: B's blocks fenced for the move's window), A stops heartbeating and its
    streams resume on B. Thawed afterwards, A finishes the move into fenced blocks nobody
    starts and frees everything; nothing is lost or sent twice.

    The streams last about 3 s here; under load the drain's first last round can come as
    the request ends, which may then end before the SIGSTOP lands (the failpoint's file
    work lets the step loop run its last step). Inferred, not traced: CI's one failure had
    every token right, nothing resumed, and a short run. With nothing left on A to lose
    the scenario did not happen, and it is tried again on a fresh cluster."""
    for attempt in range(3):
        if _freeze_the_worker_a_request_leaves(expected, tmp_path / str(attempt)):
            return
    pytest.fail("in 3 tries the request to stop ended before A stopped, every time")


def _freeze_the_worker_a_request_leaves(expected, directory) -> bool:
    """One try -> whether A stopped before the request it stopped ended there."""
    points = str(directory)
    os.makedirs(points)
    ids = [f"s{i}-{directory.name}" for i in range(len(PROMPTS))]
    with cluster(points) as c, Client(c.address, security=c.security) as client:
        failpoints.arm(points, "any", "decode.migrate", "stop")
        try:
            ended: list[float] = []
            results, (drained, other, _) = streams(
                client, lambda: drain_busiest(c), ids, ended, slow=points
            )
        finally:
            hit = failpoints.fired(points, "any", "decode.migrate")
            if hit is not None:
                os.kill(hit[0], signal.SIGCONT)
        assert hit is not None, "decode.migrate never fired"
        for (tokens, (_, reason)), want in zip(results, expected):
            assert tokens == want and reason == "length"  # none lost, none repeated
        timings = {rid: t for rid, (_, (t, _)) in zip(ids, results)}
        which = ids.index(hit[1].strip().split("~")[0])
        stopped = timings[ids[which]]
        all_free(client, timeout_s=60)  # whether the stop came in time or not
        if stopped["decode_worker"] == drained and not stopped["resumes"]:
            # it ended on A before the stop (A sent nothing after it): its end reached us
            # right after the failpoint's marker, not the seconds a resume takes
            marked = os.path.getmtime(os.path.join(points, "any.decode.migrate.fired"))
            assert ended[which] < marked + 2.0, (ended[which] - marked, stopped)
            return False
        resumed = [t for t in timings.values() if t["resumes"]]
        assert stopped in resumed and all(t["decode_worker"] == other for t in resumed), (
            which,
            drained,
            other,
            timings,
        )
        router = scrape(c.metrics["router-0"])
        assert total(router, "pdserve_router_migrations_total", outcome="failed") >= 1
        return True


def test_the_worker_a_request_goes_to_freezes_past_its_lease_mid_move(expected, tmp_path):
    """A holds the move's last round for a second while B is SIGSTOPped for longer than a
    reservation's lease (the router's renewals go unanswered): whatever A's WRITE does
    meanwhile, the move fails or B's reservation expires before the request starts there,
    and it goes on at A or resumes by recompute. Thawed, B frees every block."""
    points = str(tmp_path)
    with cluster(points, "--lease", "2") as c, Client(c.address, security=c.security) as client:
        failpoints.arm(points, "any", "decode.migrate", "pause 1")
        frozen: list[int] = []

        def freeze_the_other(pid: int, detail: str) -> None:
            victim = other_decode(c, pid)
            os.kill(victim, signal.SIGSTOP)
            frozen.append(victim)
            time.sleep(4)  # two leases
            os.kill(victim, signal.SIGCONT)

        watcher = on_fire(points, freeze_the_other)
        try:
            results, _ = streams(client, lambda: drain_busiest(c), slow=points)
        finally:
            watcher.join(timeout=10)
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        assert frozen, "decode.migrate never fired"
        for (tokens, (_, reason)), want in zip(results, expected):
            assert tokens == want and reason == "length"
        all_free(client, timeout_s=60)
