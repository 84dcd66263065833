"""The transfer layer: two agents wired together in one process, real bytes moved."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

import pytest
import torch

from transfer import (
    KV_WIRE_VERSION,
    Desc,
    HandshakeRefused,
    KVLayoutSpec,
    XferState,
    check_handshake,
    make_agent,
)
from transfer.loopback import LoopbackFabric


def pair(backend: str, a: str, b: str):
    """Two agents of `backend` that can reach each other (loopback: on one fabric)."""
    options = {"fabric": LoopbackFabric()} if backend == "loopback" else {}
    return make_agent(backend, a, **options), make_agent(backend, b, **options)


def available(backend: str) -> bool:
    try:
        make_agent(backend, f"probe-{backend}").close()
    except ValueError:
        return False
    return True


BACKENDS = [
    "loopback",
    "nixl",
    pytest.param(
        "ucxx", marks=pytest.mark.skipif(not available("ucxx"), reason="ucxx not importable")
    ),
]


def block_descs(region: int, block_ids: list[int], block_bytes: int) -> list[Desc]:
    return [Desc(region, b * block_bytes, block_bytes) for b in block_ids]


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_moves_exactly_the_described_blocks_and_notifies(backend):
    gen = torch.Generator().manual_seed(0)
    # pools of 12 blocks x 4 KiB (the layout does not matter to the agent: bytes do)
    src_pool = torch.randn(12, 1024, generator=gen)
    dst_pool = torch.full((12, 1024), float("nan"))
    block_bytes = 1024 * 4
    src, dst = pair(backend, f"{backend}-prefill", f"{backend}-decode")
    try:
        src_region = src.register(src_pool)
        dst_region = dst.register(dst_pool)
        peer = src.add_peer(dst.metadata())
        assert peer == f"{backend}-decode"
        src_blocks, dst_blocks = [3, 7, 0, 11], [5, 1, 9, 2]
        xfer = src.write(
            peer,
            block_descs(src_region, src_blocks, block_bytes),
            block_descs(dst_region, dst_blocks, block_bytes),
            notif=b"req-42",
        )
        xfer.wait(timeout_s=30)
        assert xfer.state() is XferState.DONE
        xfer.release()
        for s, d in zip(src_blocks, dst_blocks):
            assert torch.equal(dst_pool[d], src_pool[s]), f"block {s} -> {d} differs"
        untouched = [b for b in range(12) if b not in dst_blocks]
        assert dst_pool[untouched].isnan().all()
        notes: dict[str, list[bytes]] = {}
        deadline = time.monotonic() + 10
        while not notes and time.monotonic() < deadline:  # notifications arrive asynchronously
            for k, v in dst.notifications().items():
                notes.setdefault(k, []).extend(v)
            time.sleep(0.001)
        assert notes == {f"{backend}-prefill": [b"req-42"]}
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_pulls_remote_ranges(backend):
    a, b = pair(backend, f"{backend}-a", f"{backend}-b")
    try:
        local = torch.zeros(256, dtype=torch.uint8)
        remote = torch.arange(256, dtype=torch.uint8)
        la, rb = a.register(local), b.register(remote)
        peer = a.add_peer(b.metadata())
        xfer = a.read(peer, [Desc(la, 0, 16)], [Desc(rb, 100, 16)], notif=b"")
        xfer.wait()
        xfer.release()
        assert local[:16].tolist() == list(range(100, 116))
        assert local[16:].eq(0).all()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_descriptors_are_refused_before_any_byte_moves(backend):
    a, b = pair(backend, f"{backend}-x", f"{backend}-y")
    try:
        ra = a.register(torch.zeros(64, dtype=torch.uint8))
        rb = b.register(torch.zeros(64, dtype=torch.uint8))
        peer = a.add_peer(b.metadata())
        with pytest.raises(ValueError, match="overruns"):
            a.write(peer, [Desc(ra, 0, 16)], [Desc(rb, 60, 16)], b"")
        with pytest.raises(ValueError, match="unknown region"):
            a.write(peer, [Desc(ra, 0, 16)], [Desc(99, 0, 16)], b"")
        with pytest.raises(ValueError, match="lengths differ"):
            a.write(peer, [Desc(ra, 0, 16)], [Desc(rb, 0, 8)], b"")
        with pytest.raises(ValueError, match="unknown peer"):
            a.write("nobody", [Desc(ra, 0, 16)], [Desc(rb, 0, 16)], b"")
        with pytest.raises(ValueError, match="malformed"):
            a.add_peer(b"\x00garbage")
    finally:
        a.close()
        b.close()


def test_unknown_backend_names_the_valid_ones():
    with pytest.raises(
        ValueError, match="unknown 'rdma-magic'; choose one of nixl, ucxx, loopback"
    ):
        make_agent("rdma-magic", "x")


def test_loopback_agents_reach_only_peers_on_their_own_fabric():
    a, b = pair("loopback", "fa", "fb")
    stranger = make_agent("loopback", "fb", fabric=LoopbackFabric())  # same name, other fabric
    pool, into = torch.ones(4), torch.zeros(4)
    ra, rb = a.register(pool), b.register(into)
    peer = a.add_peer(b.metadata())
    a.write(peer, [Desc(ra, 0, 16)], [Desc(rb, 0, 16)], b"hello").wait()
    assert torch.equal(into, pool)
    assert stranger.notifications() == {}
    assert b.notifications() == {"fa": [b"hello"]}
    assert b.notifications() == {}  # delivered once
    with pytest.raises(ValueError, match="pass fabric=LoopbackFabric"):
        make_agent("loopback", "alone")


def test_backends_refuse_each_others_metadata():
    a = make_agent("loopback", "lb", fabric=LoopbackFabric())
    n = make_agent("nixl", "nx")
    try:
        with pytest.raises(ValueError, match="speaks transfer backend 'loopback'"):
            n.add_peer(a.metadata())
    finally:
        a.close()
        n.close()


def test_handshake_refuses_layout_and_version_mismatches():
    ours = KVLayoutSpec("llama", "float32", 16, 30, (2, 3, 64))
    check_handshake(ours, KV_WIRE_VERSION, ours.layout_hash())
    other = KVLayoutSpec("llama", "bfloat16", 16, 30, (2, 3, 64))
    assert other.layout_hash() != ours.layout_hash()
    with pytest.raises(HandshakeRefused, match="different models, dtypes, block sizes"):
        check_handshake(ours, KV_WIRE_VERSION, other.layout_hash())
    with pytest.raises(HandshakeRefused, match="wire version 99"):
        check_handshake(ours, 99, ours.layout_hash())


@pytest.mark.parametrize("backend", BACKENDS)
def test_prepared_tiles_move_the_indexed_blocks(backend):
    import numpy as np

    src_pool = torch.arange(8 * 64, dtype=torch.float32).view(8, 64)
    dst_pool = torch.zeros(6, 64)
    a, b = pair(backend, f"{backend}-ta", f"{backend}-tb")
    try:
        ra, rb = a.register(src_pool), b.register(dst_pool)
        peer = a.add_peer(b.metadata())
        local = a.prepare_tiles(None, ra, 64 * 4)
        remote = a.prepare_tiles(peer, rb, 64 * 4)
        assert (local.count, remote.count) == (8, 6)
        xfer = a.write_tiles(peer, local, np.array([7, 0, 3]), remote, np.array([1, 5, 2]), b"t")
        xfer.wait()
        xfer.release()
        assert torch.equal(dst_pool[[1, 5, 2]], src_pool[[7, 0, 3]])
        assert dst_pool[[0, 3, 4]].eq(0).all()
        with pytest.raises(ValueError, match=r"tile index outside \[0, 6\)"):
            a.write_tiles(peer, local, np.array([1]), remote, np.array([6]), b"")
    finally:
        a.close()
        b.close()


class _Pending:
    """A transfer whose state the test sets; counts its releases."""

    def __init__(self) -> None:
        self.now = XferState.PENDING
        self.released = 0

    def state(self) -> XferState:
        return self.now

    def release(self) -> None:
        self.released += 1


def test_a_retired_buffer_stays_registered_until_every_transfer_reading_it_ended():
    from transfer.retiring import Retiring

    agent = make_agent("loopback", "r", fabric=LoopbackFabric())
    kept = Retiring(agent)
    a, b = torch.zeros(4, 8), torch.zeros(2, 8)  # 128 and 64 bytes
    ra, rb = agent.register(a), agent.register(b)
    x1, x2, x3 = _Pending(), _Pending(), _Pending()
    kept.keep(a, ra, [x1, x2])
    kept.keep(b, rb, [x3])
    assert (len(kept), kept.nbytes) == (2, 192)
    x1.now = XferState.DONE  # one of a's two: a stays
    x3.now = XferState.FAILED  # b's only one, ended in error: nothing reads b any more
    assert kept.sweep() == 128 and len(kept) == 1
    assert (x1.released, x2.released, x3.released) == (0, 0, 1)
    assert sorted(agent._regions) == [ra]  # b's region deregistered, a's not
    x2.now = XferState.DONE
    assert kept.sweep() == 0 and len(kept) == 0
    assert (x1.released, x2.released) == (1, 1)
    assert agent._regions == {}
    kept.keep(a, agent.register(a), [])  # nothing posted: let go at once
    assert len(kept) == 0 and agent._regions == {}
    agent.close()


def test_peers_add_a_restarted_worker_beside_the_old_and_let_idle_ones_go_past_capacity():
    """A key (a worker's rank) whose metadata now names another agent (the worker came back
    under the same id) gets the new agent added beside the old one (a batch may still post
    to a side handed out for the old); past `capacity`, peers unused for `idle_s` go, the
    longest unused first, with their prepared tiles."""
    from transfer.wire import PoolGeometry, PoolLayout
    from transfer.writes import Peers

    net = LoopbackFabric()
    pusher = make_agent("loopback", "p", fabric=net)
    released = []
    pusher.release_tiles = released.append

    def worker(name: str):
        agent = make_agent("loopback", name, fabric=net)
        pool = torch.zeros(4, 16)
        region = agent.register(pool)
        layout = PoolLayout(0, "h", PoolGeometry(4, 64, 1), region)
        return agent, agent.metadata(), layout, pool

    peers = Peers(pusher, capacity=2, idle_s=0.2, superseded_s=600)
    w1, meta1, layout1, _p1 = worker("w1@a")
    old = peers.side("w1", meta1, layout1)
    assert old[0] == "w1@a" and peers.side("w1", meta1, layout1) == old and len(peers) == 1
    w1b, meta1b, layout1b, _p1b = worker("w1@b")  # w1 restarted: a new agent
    assert peers.side("w1", meta1b, layout1b)[0] == "w1@b"
    assert len(peers) == 2 and set(pusher._peers) == {"w1@a", "w1@b"} and released == []
    w2, meta2, layout2, _p2 = worker("w2@a")
    peers.side("w2", meta2, layout2)  # 3 > capacity, but every one was used just now
    assert len(peers) == 3 and released == []
    time.sleep(0.3)
    peers.side("w1", meta1b, layout1b)  # w1@a is the longest unused, and idle: it goes
    assert len(peers) == 2 and set(pusher._peers) == {"w1@b", "w2@a"}
    assert released == [old[1].tiles]
    # below capacity too, a restarted worker's old agent goes once unused for superseded_s
    roomy = Peers(pusher, capacity=10, idle_s=600, superseded_s=0.1)
    w3, meta3, layout3, _p3 = worker("w3@a")
    w3b, meta3b, layout3b, _p3b = worker("w3@b")
    roomy.side("w3", meta3, layout3)
    roomy.side("w3", meta3b, layout3b)
    assert len(roomy) == 2
    time.sleep(0.15)
    roomy.side("w3", meta3b, layout3b)
    assert len(roomy) == 1 and "w3@a" not in pusher._peers
    with pytest.raises(ValueError, match="capacity"):
        Peers(pusher, capacity=0)
    for agent in (pusher, w1, w1b, w2, w3, w3b):
        agent.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_notification_alone_reaches_the_peer(backend):
    a, b = pair(backend, "note-a", "note-b")
    try:
        peer = a.add_peer(b.metadata())
        sent = a.notify(peer, b"r#3#none")
        sent.wait(10)
        sent.release()
        got = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = [n for notes in b.notifications().values() for n in notes]
            time.sleep(0.01)
        assert got == [b"r#3#none"]
        with pytest.raises(ValueError, match="unknown peer"):
            a.notify("nobody", b"x")
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(not available("ucxx"), reason="ucxx not importable")
def test_a_ucxx_agent_leaves_the_processs_ucx_settings_as_it_found_them():
    """ucxx's import writes UCX_* defaults for CUDA into os.environ; left there, every NIXL
    agent made later in the process and every process started from it took them (with
    UCX_RNDV_THRESH=8192 a NIXL handoff ran 10x slower here). A fresh interpreter: ucxx's
    import side effects happen once per process, and this one's happened at collection."""
    code = (
        "import os\n"
        "from transfer import make_agent\n"
        "make_agent('ucxx', 'env-probe').close()\n"
        "print(sorted((k, v) for k, v in os.environ.items() if k.startswith('UCX_')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["UCX_RNDV_THRESH"] = "65536"  # the user's own setting stays
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    # the last line: UCX may print warnings to stdout before it
    assert proc.stdout.strip().splitlines()[-1] == "[('UCX_RNDV_THRESH', '65536')]"


@pytest.mark.skipif(not available("ucxx"), reason="ucxx not importable")
def test_a_ucxx_transfer_released_while_running_keeps_its_buffers_until_it_completes():
    """Releasing a transfer whose UCX requests still run must not free the buffers they
    read or write (its header, its acknowledgement word): they wait with the agent until
    the requests complete."""
    from transfer.ucxx_backend import UcxxTransfer

    class Running:
        now = XferState.PENDING

        def poll(self):
            return self.now

    agent = make_agent("ucxx", "orphans")
    try:
        running = Running()
        UcxxTransfer(running, agent._orphans).release()
        assert list(agent._orphans) == [running]
        time.sleep(0.3)  # the agent's thread looks many times: still running, still kept
        assert list(agent._orphans) == [running]
        running.now = XferState.DONE
        deadline = time.monotonic() + 10
        while agent._orphans:
            assert time.monotonic() < deadline, "a completed transfer was kept"
            time.sleep(0.01)
        done = Running()
        done.now = XferState.DONE
        UcxxTransfer(done, agent._orphans).release()  # complete: nothing to keep
        assert not agent._orphans
    finally:
        agent.close()


@pytest.mark.skipif(not available("ucxx"), reason="ucxx not importable")
def test_ucxx_sequence_numbers_wrap_round_past_a_transfer_that_still_runs():
    """A transfer's number is 16 bits of its tags. One abandoned with its acknowledgement
    never coming (its peer gone) keeps its receive posted; a later transfer wrapped round
    to the same number would have its acknowledgement taken by that receive and hang. The
    numbers skip those still running, and every number in use refuses a new transfer."""
    from transfer.agent import TransferFailed
    from transfer.ucxx_backend import SEQS

    a, b = pair("ucxx", "ucxx-wrap-a", "ucxx-wrap-b")
    gone = make_agent("ucxx", "ucxx-wrap-gone")
    try:
        src = torch.arange(64, dtype=torch.uint8)
        dst = torch.zeros(64, dtype=torch.uint8)
        ra, rb = a.register(src), b.register(dst)
        rg = gone.register(torch.zeros(64, dtype=torch.uint8))
        peer_b, peer_gone = a.add_peer(b.metadata()), a.add_peer(gone.metadata())
        gone.close()  # no acknowledgement will come
        lost = a.write(peer_gone, [Desc(ra, 0, 8)], [Desc(rg, 0, 8)], notif=b"")
        time.sleep(0.2)
        assert lost.state() is XferState.PENDING
        lost.release()  # abandoned while its receive is posted: kept with the agent
        (held,) = a._live_seqs
        a._seq = itertools.count(held + SEQS)  # the next number would wrap round onto it
        xfer = a.write(peer_b, [Desc(ra, 8, 8)], [Desc(rb, 8, 8)], notif=b"")
        assert a._live_seqs == {held, (held + 1) % SEQS}
        xfer.wait(timeout_s=10)  # with the same number its acknowledgement went to `lost`
        assert xfer.state() is XferState.DONE
        xfer.release()
        assert dst[8:16].tolist() == list(range(8, 16))
        assert a._live_seqs == {held}  # the abandoned one's number stays taken
        a._live_seqs |= set(range(SEQS))
        with pytest.raises(TransferFailed, match="transfers still running"):
            a.write(peer_b, [Desc(ra, 0, 8)], [Desc(rb, 0, 8)], notif=b"")
    finally:
        a.close()
        b.close()
        gone.close()


@pytest.mark.skipif(not available("ucxx"), reason="ucxx not importable")
def test_a_ucxx_transfers_number_is_freed_once_when_its_requests_end_however_it_ends():
    from transfer.ucxx_backend import UcxxTransfer, _Pending

    class Request:  # a UCX request as _Pending reads one
        def __init__(self) -> None:
            self.completed = False

        def check_error(self) -> None:
            pass

    agent = make_agent("ucxx", "ucxx-seq-free")
    try:
        ends = []
        requests = [Request(), Request()]
        pending = _Pending(requests, None, on_end=lambda: ends.append(1))
        requests[0].completed = True
        assert pending.poll() is XferState.PENDING and ends == []
        requests[1].completed = True
        assert pending.poll() is XferState.DONE and pending.poll() is XferState.DONE
        assert ends == [1]  # once, and not before every request had ended
        # released while running: the agent's thread frees its number once it completes
        seq = agent._take_seq()
        running = Request()
        freed = _Pending([running], None, on_end=lambda: agent._end_seq(seq))
        UcxxTransfer(freed, agent._orphans).release()
        time.sleep(0.2)  # the agent's thread sweeps many times meanwhile
        assert seq in agent._live_seqs
        running.completed = True
        deadline = time.monotonic() + 10
        while seq in agent._live_seqs:
            assert time.monotonic() < deadline, "a completed transfer kept its number"
            time.sleep(0.01)
    finally:
        agent.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_transfer_to_memory_the_peer_no_longer_holds_fails_within_its_deadline(backend):
    """The initiator's copy of the peer's metadata still names a region the peer has since
    let go: a READ or a WRITE of it must end, not wait forever (UCXX's READ used to: the
    target sent no payload and the initiator's receives never completed). UCXX's target
    checks the ranges and fails both; NIXL's one-sided RMA and the loopback may still reach
    the memory (it is this process's) and complete."""
    a, b = pair(backend, f"{backend}-stale-a", f"{backend}-stale-b")
    try:
        local = torch.zeros(64, dtype=torch.uint8)
        la, rb = a.register(local), b.register(torch.arange(64, dtype=torch.uint8))
        peer = a.add_peer(b.metadata())
        b.deregister(rb)
        for op in (a.read, a.write):
            try:
                xfer = op(peer, [Desc(la, 0, 16)], [Desc(rb, 0, 16)], notif=b"")
            except ValueError:  # refused at once (a backend that checks first): also fine
                continue
            deadline = time.monotonic() + 10
            while xfer.state() is XferState.PENDING:
                assert time.monotonic() < deadline, f"{op.__name__} of a gone region hangs"
                time.sleep(0.01)
            if backend == "ucxx":
                assert xfer.state() is XferState.FAILED
            xfer.release()
    finally:
        a.close()
        b.close()
