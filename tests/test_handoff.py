"""The reserve -> layer-wise push -> start handoff, with real NIXL agents, in one process."""

from __future__ import annotations

import time

import pytest
import torch
from workers import decode_worker, destination, drain, prefill_worker

from decode.worker import ReservationError, UnknownRequest
from pdserve import LLM
from pdserve.engine.args import EngineArgs
from pdserve.sampling_params import SamplingParams
from transfer import HandshakeRefused, notification

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(
    params=[
        ("tiny-llama", "nixl"),
        ("tiny-deepseek", "nixl"),
        ("tiny-llama", "ucxx"),
        ("tiny-deepseek", "ucxx"),
    ],
    ids=lambda p: "-".join(p),
)
def pair(request):
    args = EngineArgs(block_size=16, num_kv_blocks=32)
    name, backend = request.param
    prefill = prefill_worker(name, f"p-{name}-{backend}", backend, args)
    decode = decode_worker(name, f"d-{name}-{backend}", backend, args)
    yield prefill, decode, name
    prefill.close()
    decode.close()


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "after-prefill"])
def test_kv_bytes_arrive_block_for_block_and_decoding_matches(pair, layerwise):
    prefill, decode, model = pair
    prefill.layerwise = layerwise
    prompt = list(range(3, 60))  # 57 tokens: 4 blocks, the last one partial
    reserved = decode.reserve("r1", prompt, GREEDY, lease_s=30)
    blocks = reserved.block_ids
    assert len(blocks) == 4
    # snapshot the prefill side's blocks at the moment it releases them (push done)
    src, dst = prefill.core.kv_pool, decode.core.kv_pool
    bd = prefill.core.kv_block_dim
    snapshots = {}
    release = prefill.core.release

    def snapshot_then_release(request):
        snapshots.update({b: src.select(bd, b).clone() for b in request.block_ids})
        order.extend(request.block_ids)
        release(request)

    order: list[int] = []
    prefill.core.release = snapshot_then_release
    result = prefill.submit("r1", prompt, GREEDY, destination(decode, reserved)).result(60)
    assert result.transfer_bytes == 4 * decode.endpoint.bytes_per_block
    deadline = time.monotonic() + 10
    while len(order) < 4 and time.monotonic() < deadline:  # freed right after the reply
        time.sleep(0.01)
    assert len(order) == 4
    for s, d in zip(order, blocks):  # every block, every layer (and K and V), byte for byte
        assert torch.equal(snapshots[s], dst.select(bd, d)), f"block {s} -> {d} differs"
    expected = LLM(model, block_size=16).generate([prompt], GREEDY)[0]
    assert result.first_token == expected.token_ids[0]
    tokens, reason = drain(decode.start("r1", result.first_token))
    assert (tokens, reason) == (expected.token_ids, "length")
    decode.check_integrity()
    prefill.check_integrity()
    assert decode.stats().free_blocks == 32


def test_layout_mismatch_is_refused_before_prefill():
    prefill = prefill_worker(
        "tiny-llama", "p-bs16", "nixl", EngineArgs(block_size=16, num_kv_blocks=8)
    )
    decode = decode_worker(
        "tiny-llama", "d-bs32", "nixl", EngineArgs(block_size=32, num_kv_blocks=8)
    )
    try:
        reserved = decode.reserve("r", [1, 2, 3], GREEDY, lease_s=30)
        with pytest.raises(HandshakeRefused, match="layout hash"):
            prefill.submit("r", [1, 2, 3], GREEDY, destination(decode, reserved))
        assert decode.release("r", unpushed=True)  # refused before any push: no fence
        decode.check_integrity()
        assert decode.stats().free_blocks == 8
    finally:
        prefill.close()
        decode.close()


def test_lease_expiry_returns_reserved_blocks():
    decode = decode_worker("tiny-llama", "d-lease", "nixl", EngineArgs(num_kv_blocks=8))
    try:
        decode.reserve("slow", list(range(40)), GREEDY, lease_s=0.2)  # 3 blocks
        assert decode.stats().free_blocks == 5
        decode.check_integrity()
        deadline = time.monotonic() + 5
        while decode.stats().free_blocks != 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decode.stats().free_blocks == 8
        decode.check_integrity()
        # a push completing after the lease ran out (and so after its push window)
        decode.reservations.note_arrivals([notification("slow", 1)])
        with pytest.raises(UnknownRequest, match="expired or released"):
            decode.start("slow", 5)
    finally:
        decode.close()


def test_reservation_refused_when_the_pool_is_full():
    decode = decode_worker("tiny-llama", "d-full", "nixl", EngineArgs(num_kv_blocks=4))
    try:
        decode.reserve("a", list(range(48)), GREEDY, lease_s=30)  # 3 of 4 blocks
        with pytest.raises(ReservationError, match="2 KV blocks needed, 1 free"):
            decode.reserve("b", list(range(20)), GREEDY, lease_s=30)
        with pytest.raises(ValueError, match="already known"):
            decode.reserve("a", [1], GREEDY, lease_s=30)
        decode.release("a")
        decode.check_integrity()
    finally:
        decode.close()


def test_prefill_prompts_that_do_not_fit_together_wait_for_the_next_batch():
    args = EngineArgs(block_size=16, num_kv_blocks=4, enable_prefix_caching=False)
    prefill = prefill_worker("tiny-llama", "p-small", "nixl", args)
    decode = decode_worker("tiny-llama", "d-big", "nixl", EngineArgs(num_kv_blocks=32))
    try:
        a, b = list(range(10, 58)), list(range(60, 100))  # 3 + 3 blocks > 4 in one batch
        futures = []
        for rid, prompt in (("a", a), ("b", b)):
            reserved = decode.reserve(rid, prompt, GREEDY, lease_s=30)
            futures.append(prefill.submit(rid, prompt, GREEDY, destination(decode, reserved)))
        first = [f.result(60).first_token for f in futures]
        expected = LLM("tiny-llama").generate([a, b], GREEDY)
        assert first == [o.token_ids[0] for o in expected]  # the carried one too
        too_big = list(range(5, 5 + 16 * 5))  # 5 blocks: never fits a 4-block pool
        reserved = decode.reserve("c", too_big, GREEDY, lease_s=30)
        with pytest.raises(ValueError, match="needs 6 KV blocks but the pool has 4"):
            prefill.submit("c", too_big, GREEDY, destination(decode, reserved))
        for rid in ("a", "b", "c"):
            decode.release(rid)
        decode.check_integrity()
        deadline = time.monotonic() + 5
        while prefill.stats().free_blocks != 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        prefill.check_integrity()
        assert prefill.stats().queued_tokens == 0
    finally:
        prefill.close()
        decode.close()


def test_push_notifications_never_outlive_their_reservation():
    """A push-complete notification is kept only while its reservation is held: collected
    while another request starts, it goes when its own reservation is released (the set of
    arrivals used to grow for the life of the process)."""
    prefill = prefill_worker("tiny-llama", "p-notes", "nixl", EngineArgs(num_kv_blocks=16))
    decode = decode_worker("tiny-llama", "d-notes", "nixl", EngineArgs(num_kv_blocks=16))
    try:
        futures = []
        for rid in ("a", "b"):
            prompt = [5, 6, 7, 8] if rid == "a" else [9, 10, 11]
            reserved = decode.reserve(rid, prompt, GREEDY, lease_s=30)
            futures.append(prefill.submit(rid, prompt, GREEDY, destination(decode, reserved)))
        first = [f.result(60).first_token for f in futures]  # both pushes done and notified
        tokens, _ = drain(decode.start("a", first[0]))  # collects a's and b's notifications
        assert len(tokens) == GREEDY.max_tokens
        assert decode.reservations.pending_arrivals == 1  # b's, while b is still reserved
        assert decode.release("b")
        assert decode.reservations.pending_arrivals == 0
        decode.reservations.note_arrivals([notification("ghost", 99)])  # of none: dropped
        assert decode.reservations.pending_arrivals == 0
        decode.check_integrity()
        assert decode.stats().free_blocks == 16
    finally:
        prefill.close()
        decode.close()


def test_a_prefill_past_its_deadline_pushes_nothing_and_the_blocks_stay_fenced():
    """The router's deadline bounds the push: a prompt whose deadline passed in the queue is
    neither computed nor pushed (PrefillDeadline), and the decode worker, told only that the
    reservation ended, keeps its blocks out of the pool until the push window is over."""
    from prefill.worker import PrefillDeadline, nothing_posted

    prefill = prefill_worker("tiny-llama", "p-late", "nixl", EngineArgs(num_kv_blocks=16))
    decode = decode_worker("tiny-llama", "d-late", "nixl", EngineArgs(num_kv_blocks=16))
    try:
        prompt = list(range(3, 40))  # 3 blocks
        reserved = decode.reserve("late", prompt, GREEDY, lease_s=30, push_window_s=1.0)
        future = prefill.submit(
            "late", prompt, GREEDY, destination(decode, reserved), deadline=time.monotonic() - 1
        )
        with pytest.raises(PrefillDeadline, match="deadline passed") as failed:
            future.result(30)
        assert nothing_posted(failed.value)  # the router may release it unfenced (below)
        assert prefill.stats().queued_tokens == 0
        assert decode.release("late")
        assert decode.stats().free_blocks == 13 and decode.reservations.fenced == 1
        deadline = time.monotonic() + 10
        while decode.stats().free_blocks != 16:  # the step loop frees it after the window
            assert time.monotonic() < deadline, "the fence never ended"
            time.sleep(0.05)
        assert decode.reservations.pending_arrivals == 0 and decode.reservations.fenced == 0
        decode.check_integrity()
        prefill.check_integrity()
    finally:
        prefill.close()
        decode.close()


def test_a_peer_that_disconnects_mid_push_fails_that_batch_only():
    """Issue 14's critical wedge: NIXL raises its own exception classes (not RuntimeError)
    when a decode worker disconnects after its metadata was loaded ("postXferReq: remote
    agent ... was disconnected after transfer request creation"); the prefill loop caught
    only RuntimeError and friends, so the exception ended its thread: the worker stayed up,
    heartbeated, and never completed another prompt. Now the post fails as TransferFailed
    (ABORTED at the edge: retry with a new reservation) and the next prompt is served."""
    from nixl_cu12._bindings import nixlRemoteDisconnectError

    from transfer import TransferFailed

    prefill = prefill_worker("tiny-llama", "p-disc", "nixl", EngineArgs(num_kv_blocks=16))
    decode = decode_worker("tiny-llama", "d-disc", "nixl", EngineArgs(num_kv_blocks=16))
    nixl = prefill.endpoint.agent._agent
    post = nixl.transfer
    try:

        def disconnected(handle, *args, **kwargs):
            raise nixlRemoteDisconnectError("remote agent 'd-disc' was disconnected")

        nixl.transfer = disconnected
        prompt = [5, 6, 7, 8, 9]
        reserved = decode.reserve("gone", prompt, GREEDY, lease_s=30)
        with pytest.raises(TransferFailed, match="disconnected"):
            prefill.submit("gone", prompt, GREEDY, destination(decode, reserved)).result(30)
        nixl.transfer = post  # the peer is back (or another one asks)
        reserved = decode.reserve("next", prompt, GREEDY, lease_s=30)
        result = prefill.submit("next", prompt, GREEDY, destination(decode, reserved)).result(30)
        tokens, _ = drain(decode.start("next", result.first_token))
        assert len(tokens) == GREEDY.max_tokens
        assert decode.release("gone", unpushed=True)
        decode.check_integrity()
        prefill.check_integrity()
    finally:
        nixl.transfer = post
        prefill.close()
        decode.close()


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "after-prefill"])
def test_a_dead_decode_worker_fails_only_its_own_requests_of_a_batch(layerwise):
    """One prefill batch pushes to two decode workers and one of them disconnects (its
    WRITEs refused at posting, as NIXL refuses them for a peer that went away): only its
    request fails (TransferFailed, ABORTED at the edge); the other request's KV lands and it
    decodes the colocated engine's tokens. Failing the whole batch made the router fence the
    survivor's reserved blocks for a whole push window (182 s by default), which wedged a
    small pool (the flaky tests/test_survival.py mid-spill test)."""
    import threading

    from prefill.worker import nothing_posted
    from transfer import TransferFailed

    args = EngineArgs(num_kv_blocks=16)
    prefill = prefill_worker("tiny-llama", "p-split", "nixl", args)
    prefill.layerwise = layerwise
    gone = decode_worker("tiny-llama", "d-gone", "nixl", args)
    alive = decode_worker("tiny-llama", "d-alive", "nixl", args)
    agent = prefill.endpoint.agent
    write, write_tiles = agent.write, agent.write_tiles
    held, release = threading.Event(), threading.Event()
    prefill_pass, batches = prefill.core.prefill, []

    def refuse(post):
        def posted(peer, *args):
            if peer == "d-gone":
                raise TransferFailed("remote agent 'd-gone' was disconnected")
            return post(peer, *args)

        return posted

    def hold_first(requests, **kwargs):  # the first pass waits: the next batch holds both
        batches.append([r.request_id for r in requests])
        if len(batches) == 1:
            held.set()
            assert release.wait(30)
        return prefill_pass(requests, **kwargs)

    agent.write, agent.write_tiles = refuse(write), refuse(write_tiles)
    prefill.core.prefill = hold_first
    try:
        warm = [3, 4, 5]
        reserved = alive.reserve("warm", warm, GREEDY, lease_s=30)
        first = prefill.submit("warm", warm, GREEDY, destination(alive, reserved))
        assert held.wait(30)
        a, b = list(range(10, 40)), list(range(50, 75))
        futures = {}
        for rid, prompt, decode in (("a", a, gone), ("b", b, alive)):
            reserved = decode.reserve(rid, prompt, GREEDY, lease_s=30)
            futures[rid] = prefill.submit(rid, prompt, GREEDY, destination(decode, reserved))
        release.set()
        first.result(60)
        with pytest.raises(TransferFailed, match="to d-gone failed") as failed:
            futures["a"].result(60)
        # its WRITEs were refused at posting, but a refused post may have started some of
        # its puts: the router is not told "nothing posted", so its blocks stay fenced
        assert not nothing_posted(failed.value)
        result = futures["b"].result(60)
        assert batches[1] == ["a", "b"]  # one batch, two destinations
        expected = LLM("tiny-llama").generate([b], GREEDY)[0].token_ids
        assert drain(alive.start("b", result.first_token)) == (expected, "length")
        assert alive.release("warm")
        # (a dead worker's reservation goes with it; here its books are cleared by hand,
        # unpushed: the refusal above is this test's, before the transport saw a WRITE)
        assert gone.release("a", unpushed=True)
        for w in (alive, gone):
            w.check_integrity()
            assert w.reservations.fenced == 0
        _await_freed(prefill)  # right after the replies
        prefill.check_integrity()
    finally:
        release.set()
        agent.write, agent.write_tiles = write, write_tiles
        prefill.close()
        gone.close()
        alive.close()


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "after-prefill"])
@pytest.mark.parametrize("fault", ["pass", "push"])
def test_a_failed_prefill_says_whether_any_write_of_it_was_posted(layerwise, fault):
    """What the router is told (prefill/service.py's UNPOSTED_KEY) decides whether the
    reservation is fenced for a whole push window: a job that failed before any WRITE of it
    was handed to the transport (after the pass: its forward pass raised) says so; one with
    a WRITE handed over does not, even one the transport refused (it may have started some
    of its puts): layer-wise, the first layer went out, then the pass raised or the next
    WRITE was refused; after the pass, its one WRITE was refused."""
    from prefill.worker import nothing_posted
    from transfer import TransferFailed

    args = EngineArgs(num_kv_blocks=16)
    prefill = prefill_worker("tiny-llama", f"p-{fault}", "nixl", args)
    prefill.layerwise = layerwise
    decode = decode_worker("tiny-llama", f"d-{fault}", "nixl", args)
    agent = prefill.endpoint.agent
    write, write_tiles, prefill_pass = agent.write, agent.write_tiles, prefill.core.prefill
    writes = []

    def refuse(post):  # layer-wise, the first WRITE goes out; every other is refused
        def posted(peer, *a):
            writes.append(peer)
            if len(writes) > (1 if layerwise else 0):
                raise TransferFailed(f"remote agent {peer!r} was disconnected")
            return post(peer, *a)

        return posted

    if fault == "push":
        agent.write, agent.write_tiles = refuse(write), refuse(write_tiles)
    else:
        prefill.core.prefill = _fails_after_the_first_layer
    try:
        prompt = list(range(3, 40))
        reserved = decode.reserve("r", prompt, GREEDY, lease_s=30)
        future = prefill.submit("r", prompt, GREEDY, destination(decode, reserved))
        with pytest.raises((RuntimeError, TransferFailed)) as failed:
            future.result(60)
        posted = layerwise or fault == "push"
        assert nothing_posted(failed.value) is not posted, (failed.value, writes)
        _await_freed(prefill)
        prefill.check_integrity()
    finally:
        agent.write, agent.write_tiles = write, write_tiles
        prefill.core.prefill = prefill_pass
        prefill.close()
        decode.close()


def _fails_after_the_first_layer(requests, on_layer_done=None, **kwargs):
    """A prefill pass that raises; layer-wise, after layer 0's WRITE was posted."""
    if on_layer_done is not None:
        on_layer_done(0)
    raise RuntimeError("the forward pass failed")


def _await_freed(prefill, timeout_s: float = 10.0) -> None:
    """Until every block of the prefill worker is free (they go right after a reply)."""
    deadline = time.monotonic() + timeout_s
    while prefill.stats().free_blocks != prefill.stats().total_blocks:
        assert time.monotonic() < deadline, "the prefill worker kept blocks"
        time.sleep(0.01)


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "after-prefill"])
def test_the_prefill_service_tells_the_router_when_nothing_was_posted(layerwise):
    """Over gRPC: a Prefill whose forward pass failed ends UNAVAILABLE, with UNPOSTED_KEY
    in its trailers when no WRITE of it was posted (after the pass), without when one was
    (layer-wise: layer 0 went out first)."""
    import grpc

    from decode.service import DecodeService
    from pdserve.rpc import UNPOSTED_KEY
    from pdserve.rpc import pdserve_pb2 as pb
    from pdserve.rpc import pdserve_pb2_grpc as rpc
    from pdserve.serving.server import start_server
    from prefill.service import PrefillService

    args = EngineArgs(num_kv_blocks=16)
    prefill = prefill_worker("tiny-llama", "p-svc", "nixl", args)
    prefill.layerwise = layerwise
    decode = decode_worker("tiny-llama", "d-svc", "nixl", args)

    prefill.core.prefill = _fails_after_the_first_layer
    servers, stubs = [], []
    try:
        for add, stub in (
            (lambda s: rpc.add_DecodeServicer_to_server(DecodeService(decode), s), rpc.DecodeStub),
            (
                lambda s: rpc.add_PrefillServicer_to_server(PrefillService(prefill), s),
                rpc.PrefillStub,
            ),
        ):
            server, port = start_server(add, "127.0.0.1", 0)
            servers.append(server)
            stubs.append(stub(grpc.insecure_channel(f"127.0.0.1:{port}")))
        sampling = pb.SamplingParams(max_tokens=4, top_p=1.0)
        prompt = list(range(3, 40))
        held = stubs[0].Reserve(
            pb.ReserveRequest(
                request_id="r", prompt_token_ids=prompt, sampling=sampling, lease_s=30
            ),
            timeout=10,
        )
        with pytest.raises(grpc.RpcError) as failed:
            stubs[1].Prefill(
                pb.PrefillRequest(
                    request_id="r",
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    dest_worker_id=held.worker_id,
                    dest_block_ids=held.block_ids,
                    dest_layout=held.layout,
                    dest_agent_metadata=held.agent_metadata,
                    dest_fence=held.fence,
                ),
                timeout=30,
            )
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the forward pass failed" in failed.value.details()
        trailers = dict(failed.value.trailing_metadata() or ())
        assert (UNPOSTED_KEY in trailers) is not layerwise, trailers
    finally:
        for server in servers:
            server.stop(grace=0)
        prefill.close()
        decode.close()


def test_a_prefill_call_cancelled_while_queued_is_dropped_uncomputed():
    """Over gRPC: a Prefill whose caller cancels it (the router does when its client goes)
    while it waits behind another prompt is dropped when its turn comes: never computed,
    nothing posted, counted, and the decode worker told so (its blocks need not wait out
    the push window); the prompt ahead is served as usual."""
    import threading

    import grpc

    from pdserve.rpc import pdserve_pb2 as pb
    from pdserve.rpc import pdserve_pb2_grpc as rpc
    from pdserve.serving.kv_pool import layout_to_proto
    from pdserve.serving.server import start_server
    from prefill.service import PrefillService

    args = EngineArgs(num_kv_blocks=16)
    prefill = prefill_worker("tiny-llama", "p-cancel", "nixl", args)
    decode = decode_worker("tiny-llama", "d-cancel", "nixl", args)
    go, passes = threading.Event(), []
    compute = prefill.core.prefill

    def held(requests, **kwargs):  # the first pass waits for `go`
        passes.append([r.request_id for r in requests])
        assert go.wait(30)
        return compute(requests, **kwargs)

    prefill.core.prefill = held
    asked = {}
    submit = prefill.submit

    def seen(request_id, *args, **kwargs):
        asked[request_id] = kwargs.get("gone")
        return submit(request_id, *args, **kwargs)

    prefill.submit = seen
    server, port = start_server(
        lambda s: rpc.add_PrefillServicer_to_server(PrefillService(prefill), s), "127.0.0.1", 0
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        first_prompt, prompt = list(range(3, 40)), list(range(5, 30))
        ahead = prefill.submit(
            "ahead",
            first_prompt,
            GREEDY,
            destination(decode, decode.reserve("ahead", first_prompt, GREEDY, lease_s=30)),
        )
        wait_until = time.monotonic() + 10
        while not passes:  # "ahead" is being computed: the next prompt queues
            assert time.monotonic() < wait_until
            time.sleep(0.01)
        held_by = decode.reserve("r", prompt, GREEDY, lease_s=30)
        call = rpc.PrefillStub(channel).Prefill.future(
            pb.PrefillRequest(
                request_id="r",
                prompt_token_ids=prompt,
                sampling=pb.SamplingParams(max_tokens=6, top_p=1.0, ignore_eos=True),
                dest_worker_id=decode.worker_id,
                dest_block_ids=held_by.block_ids,
                dest_layout=layout_to_proto(decode.endpoint.layout),
                dest_agent_metadata=decode.endpoint.agent.metadata(),
                dest_fence=held_by.fence,
            ),
            timeout=30,
        )
        while "r" not in asked:  # queued behind "ahead"
            assert time.monotonic() < wait_until
            time.sleep(0.01)
        assert prefill.stats().queued_tokens == len(prompt)
        assert not asked["r"]()  # its caller is there
        call.cancel()
        while not asked["r"]():  # the server saw the cancellation
            assert time.monotonic() < wait_until
            time.sleep(0.01)
        go.set()
        assert ahead.result(30).first_token >= 0
        while prefill.metrics.cancelled._value.get() != 1:
            assert time.monotonic() < wait_until, "the cancelled prompt was not dropped"
            time.sleep(0.01)
        assert passes == [["ahead"]]  # "r" never computed
        assert prefill.stats().queued_tokens == 0
        _await_freed(prefill)
        prefill.check_integrity()
        # the router, its call cancelled, released the reservation as it does (fenced: it
        # cannot know that nothing was posted); the prefill worker's note frees it at once,
        # not at the end of the push window (minutes)
        assert decode.release("ahead") and decode.release("r")
        while decode.stats().free_blocks != 16 or decode.reservations.fenced:
            assert time.monotonic() < wait_until + 10, "the dropped prompt's blocks stayed fenced"
            time.sleep(0.01)
        decode.check_integrity()
    finally:
        go.set()
        server.stop(grace=0)
        channel.close()
        prefill.close()
        decode.close()


def test_a_failure_is_said_unposted_on_a_copy_per_job_or_not_at_all():
    """One error often fails every job of a batch: the flag goes on a copy for the job that
    posted nothing, never on the shared error; an error that cannot be copied (its class
    takes other arguments) is passed on as it is, unflagged (its blocks stay fenced)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from prefill.worker import _fail, nothing_posted

    class Odd(RuntimeError):
        def __init__(self, a, b):
            super().__init__(f"{a} {b}")

    shared = RuntimeError("the forward pass failed")
    jobs = [SimpleNamespace(done=Future()) for _ in range(3)]
    _fail(jobs[0], shared, posted=False)
    _fail(jobs[1], shared, posted=True)
    odd = Odd(1, 2)
    _fail(jobs[2], odd, posted=False)
    unposted, posted, uncopied = (j.done.exception() for j in jobs)
    assert nothing_posted(unposted) and str(unposted) == str(shared) and unposted is not shared
    assert posted is shared and not nothing_posted(shared)
    assert uncopied is odd and not nothing_posted(odd)
