"""A batch's push fails target by target: one decode worker going away (its WRITE refused at
posting, ending FAILED, or never completing) fails only the requests pushed to it; the
batch's other pushes land whole and nothing more is posted to the failed one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from prefill.push import BatchPush, PushTarget
from transfer import PoolGeometry, TransferFailed, XferState
from transfer.agent import Transfer
from transfer.loopback import LoopbackAgent, LoopbackFabric
from transfer.writes import PoolSide

LAYERS, PLANES, BLOCKS, ELEMS = 3, 2, 8, 16


class _Stuck(Transfer):
    def __init__(self, state: XferState) -> None:
        self._state = state
        self.released = False

    def state(self) -> XferState:
        return self._state

    def release(self) -> None:
        self.released = True


class FaultyAgent(LoopbackAgent):
    """A loopback agent whose WRITEs to the peers in `faults` go wrong: "post" (refused at
    posting), "failed" (posted, ends FAILED), "hang" (posted, never completes). Counts the
    WRITEs posted to each peer."""

    def __init__(self, name: str, fabric: LoopbackFabric) -> None:
        super().__init__(name, fabric)
        self.faults: dict[str, str] = {}
        self.posted: dict[str, int] = {}
        self.stuck: list[_Stuck] = []

    def write(self, peer, local, remote, notif) -> Transfer:
        fault = self.faults.get(peer)
        if fault == "post":
            raise TransferFailed(f"remote agent {peer!r} was disconnected")
        if fault == "raise":  # not a transfer's failure: a bug, a bad descriptor
            raise ValueError(f"unknown peer {peer!r}")
        self.posted[peer] = self.posted.get(peer, 0) + 1
        if fault is None:
            return super().write(peer, local, remote, notif)
        self.stuck.append(_Stuck(XferState.FAILED if fault == "failed" else XferState.PENDING))
        return self.stuck[-1]


@pytest.fixture
def fabric():
    """A pushing agent and three decode pools (peers "b", "c", "d"), all loopback."""
    net = LoopbackFabric()
    a = FaultyAgent("a", net)
    bb = ELEMS * 4
    src = torch.randn(LAYERS * PLANES, BLOCKS, ELEMS)
    local = PoolSide(PoolGeometry(BLOCKS, bb, PLANES), a.register(src), None)
    pools, sides, agents = {}, {}, [a]
    for name in "bcd":
        other = LoopbackAgent(name, net)
        agents.append(other)
        pools[name] = torch.zeros(LAYERS * PLANES, BLOCKS, ELEMS)
        region = other.register(pools[name])
        peer = a.add_peer(other.metadata())
        sides[name] = PoolSide(PoolGeometry(BLOCKS, bb, PLANES), region, None)
        assert peer == name
    yield a, local, src, pools, sides
    for agent in agents:
        agent.close()


def _targets(sides, peers, done_by=float("inf")):
    """One target per peer named, each pushing blocks [i, i+1] into the peer's [0, 1]."""
    return [
        PushTarget(
            peer=p,
            remote=sides[p],
            src=np.array([2 * i, 2 * i + 1]),
            dst=np.array([0, 1]),
            notif=f"req-{i}".encode(),
            done_by=done_by,
        )
        for i, p in enumerate(peers)
    ]


def _landed(src, pool, i) -> bool:
    return torch.equal(pool[:, :2], src[:, 2 * i : 2 * i + 2])


@pytest.mark.parametrize("layerwise", [True, False])
@pytest.mark.parametrize("fault", ["post", "failed"])
def test_one_dead_peer_fails_only_its_own_target(fabric, layerwise, fault):
    a, local, src, pools, sides = fabric
    a.faults["c"] = fault
    push = BatchPush(a, local, _targets(sides, ["b", "c", "d"]), LAYERS, "w")
    if layerwise:
        for layer in range(LAYERS):
            push.layers(range(layer, layer + 1))
    else:
        push.layers(range(LAYERS))
    push.wait(timeout_s=5.0, poll_s=0.001)
    assert list(push.failed) == [1] and "to c failed" in push.failed[1]
    assert not push.abandoned
    assert _landed(src, pools["b"], 0) and _landed(src, pools["d"], 2)
    assert not pools["c"].any()
    # nothing more went to c once its first WRITE failed
    assert a.posted.get("c", 0) == (0 if fault == "post" else 1)
    assert a.posted["b"] == a.posted["d"] == (LAYERS if layerwise else 1)
    notes = {k: v for k, v in a.fabric._inboxes.items()}
    assert notes["b"] == {"a": [b"req-0"]} and notes["d"] == {"a": [b"req-2"]}
    assert "c" not in notes
    assert len(push.spans()) == (LAYERS if layerwise else 1)  # every layer has its end
    # the failed WRITE was let go when it failed, not when the batch ended
    assert [x.released for x in a.stuck] == ([] if fault == "post" else [True])
    if not layerwise:
        assert "the push of every layer to c failed" in push.failed[1]
    push.release()


def test_posted_names_every_target_a_write_was_handed_over_for(fabric):
    """posted() is what lets the router free a failed request's reserved blocks unfenced
    (prefill/worker.py): a target counts once a WRITE was handed to the agent for it,
    refused or not, and also when the agent raised something else midway through the
    batch (the WRITEs posted before it went out and are still in flight)."""
    a, local, _, _, sides = fabric
    a.faults.update(c="post", d="raise")
    push = BatchPush(a, local, _targets(sides, ["b", "c", "d", "b"]), LAYERS, "w")
    assert push.posted() == set()
    with pytest.raises(ValueError, match="unknown peer 'd'"):
        push.layers(range(0, 1))
    # b's WRITE went out, c's was refused (it may have started), d raised: the last
    # target was never reached
    assert push.posted() == {0, 1, 2}
    # and b's WRITE, handed over before d raised, is tracked: polled, timed and released
    assert push.poll() and len(push.spans()) == 1
    push.release()


def test_every_peer_failing_fails_every_target(fabric):
    a, local, _, _, sides = fabric
    a.faults.update(b="post", c="failed")
    push = BatchPush(a, local, _targets(sides, ["b", "c"]), LAYERS, "w")
    push.layers(range(LAYERS))
    push.wait(timeout_s=5.0, poll_s=0.001)
    assert sorted(push.failed) == [0, 1]


def test_a_push_that_never_completes_fails_at_its_deadline_alone(fabric):
    """A WRITE stuck PENDING fails its target when `timeout_s` runs out; the other target,
    complete long before, is not failed with it."""
    a, local, src, pools, sides = fabric
    a.faults["c"] = "hang"
    push = BatchPush(a, local, _targets(sides, ["b", "c"]), LAYERS, "w")
    push.layers(range(LAYERS))
    push.wait(timeout_s=0.2, poll_s=0.01)
    assert push.failed == {1: "the push to c was not complete within push_timeout_s (0.2 s)"}
    assert _landed(src, pools["b"], 0)


def test_a_targets_own_done_by_ends_its_wait_before_the_timeout(fabric):
    import time

    a, local, _, _, sides = fabric
    a.faults["b"] = "hang"
    target = _targets(sides, ["b"], done_by=time.monotonic() + 0.1)
    push = BatchPush(a, local, target, LAYERS, "w")
    push.layers(range(LAYERS))
    began = time.monotonic()
    push.wait(timeout_s=30.0, poll_s=0.01)
    assert time.monotonic() - began < 5.0
    assert push.failed == {0: "the push to b was not complete by the caller's deadline"}
    assert a.stuck[0].released


def test_a_complete_target_is_answered_by_its_own_deadline_whatever_the_others_do(fabric):
    """Target 0 is complete at once, target 1 hangs with a later deadline: the wait ends
    at target 0's deadline (its caller stops waiting then), failing only target 1."""
    import time

    a, local, src, pools, sides = fabric
    a.faults["c"] = "hang"
    targets = _targets(sides, ["b", "c"], done_by=time.monotonic() + 30.0)
    targets[0] = dataclasses.replace(targets[0], done_by=time.monotonic() + 0.2)
    push = BatchPush(a, local, targets, LAYERS, "w")
    push.layers(range(LAYERS))
    began = time.monotonic()
    push.wait(timeout_s=60.0, poll_s=0.01)
    assert time.monotonic() - began < 5.0
    assert list(push.failed) == [1] and _landed(src, pools["b"], 0)
