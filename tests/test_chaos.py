"""bench chaos's books (pdserve/bench/chaos.py): how each request's ending is counted, and
when a report fails. The benchmark itself launches clusters (docs/results/chaos.json); the
same faults run as tests in tests/test_survival.py."""

from __future__ import annotations

from pdserve.bench.chaos import DEADLINE_S, Outcome, _summary, ok
from pdserve.bench.faults import FAULT_HELP, FAULTS, STATES
from pdserve.bench.probes import outcomes_since
from pdserve.bench.prometheus import total
from pdserve.bench.strike import POINT
from pdserve.failpoints import POINTS


def test_every_ending_is_counted_once():
    want = [[1, 2, 3]] * 7
    outcomes = [
        Outcome([1, 2, 3], {"resumes": 0}),  # completed, equal
        Outcome([1, 2, 3], {"resumes": 2}),  # completed after two resumes
        Outcome([1, 2, 4], {"resumes": 0}),  # completed, wrong tokens
        Outcome([1], status="UNAVAILABLE"),  # failed, typed
        Outcome([], status="DEADLINE_EXCEEDED", seconds=DEADLINE_S),  # hung
        Outcome([1, 2], walked_away=True),  # the client left (the cancel fault)
        Outcome([1, 2]),  # ended with neither a final message nor a status: lost
    ]
    row = _summary("x", outcomes, want, 3, 1.0, True)
    assert (row["completed"], row["equal"], row["resumed"]) == (3, 2, 1)
    assert row["failed"] == {"UNAVAILABLE": 1}
    assert (row["hung"], row["lost"], row["walked_away"]) == (1, 1, 1)
    assert row["duplicated_tokens"] == 0
    row["leaked"] = {"blocks": 0, "spill_blocks": 0}
    assert not ok({"benchmark": "soak", **row})  # hung, lost, a wrong output
    clean = _summary("y", outcomes[:2] + outcomes[3:4], want, 3, 1.0, True)
    clean["leaked"] = {"blocks": 0, "spill_blocks": 0}
    assert ok({"benchmark": "soak", **clean})  # a typed failure is allowed
    clean["leaked"] = {"blocks": 2, "spill_blocks": 0}
    assert not ok({"benchmark": "soak", **clean})
    bug = _summary("z", outcomes[:1] + [Outcome([1], status="INTERNAL")], want, 3, 1.0, True)
    bug["leaked"] = {"blocks": 0, "spill_blocks": 0}
    assert not ok({"benchmark": "soak", **bug})  # typed, but the router's own bug


def test_router_outcomes_are_counted_per_phase_across_a_restart():
    from collections import Counter

    before = (100, Counter(length=10, cancelled=2))
    assert outcomes_since(before, (100, Counter(length=14, cancelled=2))) == {"length": 4}
    # a restarted router (another pid) counts from zero: what it counted is all there is,
    # even when it has counted more than the first one had
    assert outcomes_since(before, (200, Counter(length=30, failed_unavailable=1))) == {
        "failed_unavailable": 1,
        "length": 30,
    }
    assert outcomes_since(None, before) is None and outcomes_since(before, None) is None


def test_metrics_are_read_per_series_or_summed():
    text = (
        "pdserve_decode_running 3.0\n"
        "pdserve_decode_running_total 9.0\n"
        'pdserve_decode_reservations{state="held"} 2.0\n'
        'pdserve_decode_reservations{state="fenced"} 1.0\n'
        'pdserve_decode_spill_used_blocks{tier="host"} 4.0\n'
        'pdserve_decode_spill_used_blocks{tier="disk"} 1.0\n'
    )
    assert total(text, "pdserve_decode_running") == 3.0
    assert total(text, "pdserve_decode_reservations", state="fenced") == 1.0
    assert total(text, "pdserve_decode_spill_used_blocks") == 5.0
    assert total(text, "pdserve_decode_spill_used_blocks", tier="cxl") == 0.0


def test_every_fault_is_explained():
    assert FAULTS[0] == "none" and set(FAULTS) == set(FAULT_HELP)
    assert all(FAULT_HELP[f] for f in FAULTS)


def test_every_state_has_its_failpoint():
    """Each state a fault can strike at is marked by a real failpoint, and every worker
    fault exists for both signals at every state of its role."""
    for role, states in STATES.items():
        for state in states:
            if not (role == "prefill" and state == "stream"):  # a moment, not a state
                assert POINT[state] in POINTS
            if role != "cancel":
                assert {f"{role}-kill@{state}", f"{role}-stop@{state}"} <= set(FAULTS)
            else:
                assert f"cancel@{state}" in FAULTS


def test_the_migration_faults_drain_a_worker_and_strike_at_the_move(tmp_path):
    """A fault on the live-migration path needs a move under way: the bench drains a decode
    worker once half the streams run, and the failpoint at the move's last round strikes
    the source itself (kill, stop), the client (cancel), or the destination."""
    from types import SimpleNamespace

    from pdserve.bench.strike import Strike

    cluster = SimpleNamespace(names=[], procs=[])
    want = {
        "decode-kill@migrate": ("kill", ""),
        "decode-stop@migrate": ("stop", "cont"),
        "cancel@migrate": ("pause 1.0", "cancel"),
        "migrate-dest-kill": ("pause 1.0", "kill-dest"),
        "migrate-dest-stop": ("pause 1.0", "stop-dest"),
    }
    assert {f for f in FAULTS if "migrate" in f} == set(want)
    for fault, (action, react) in want.items():
        s = Strike.arm(fault, cluster, str(tmp_path), None, 8, 10.0)
        armed = (tmp_path / "any.decode.migrate").read_text()
        assert (s.point, armed, s.react) == ("decode.migrate", action, react), fault
        assert (s.drain, s._drain_at) == ("due", 4)
        s.finish()  # disarmed; nothing was drained, nothing to undo
        assert not (tmp_path / "any.decode.migrate").exists()
    other = Strike.arm("decode-kill@stream", cluster, str(tmp_path), None, 8, 10.0)
    assert other.drain == ""
    other.finish()
