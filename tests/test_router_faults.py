"""The router when workers misbehave: every request's outcome counted
(pdserve_router_requests_total), a forgotten worker's series gone from /metrics, a frozen
worker skipped at once. Real gRPC servers in this process, a slow fake
decode worker (tests/test_auth.py) so that a stream can be cut mid-way."""

from __future__ import annotations

import time

import grpc
import pytest
from test_auth import FakePrefill, SlowDecode

from pdserve.client import Client
from pdserve.router.config import RouterConfig
from pdserve.router.service import RouterService
from pdserve.rpc import PROTOCOL_VERSION, UNPOSTED_KEY
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.server import health, start_server


def outcomes(service: RouterService) -> dict[str, float]:
    return {
        s.labels["outcome"]: s.value
        for metric in service.metrics.registry.collect()
        if metric.name == "pdserve_router_requests"
        for s in metric.samples
        if s.name.endswith("_total")
    }


@pytest.fixture
def router(request):
    servers = []

    def serve(add) -> str:
        server, port = start_server(add, "127.0.0.1", 0)
        servers.append(server)
        return f"127.0.0.1:{port}"

    # a test may set more fields, or other values of these (indirect parametrization)
    fields = {"max_model_len": 64, "queue_timeout_s": 0.5, "reserve_rpc_timeout_s": 0.3}
    config = RouterConfig(**{**fields, **getattr(request, "param", {})})
    service = RouterService(config, 100, None)
    address = serve(lambda s: rpc.add_RouterServicer_to_server(service, s))

    def register(wid: str, role: str, free: int = 8, headroom: int = 8, servicer=None) -> None:
        if servicer is None:
            servicer = SlowDecode() if role == "decode" else FakePrefill()
        add = (
            rpc.add_DecodeServicer_to_server
            if role == "decode"
            else rpc.add_PrefillServicer_to_server
        )
        at = serve(lambda s: add(servicer, s))
        info = pb.WorkerInfo(
            worker_id=wid,
            role=role,
            address=at,
            total_blocks=8,
            free_blocks=free,
            headroom_blocks=headroom,
        )
        rpc.RouterStub(channel).Register(
            pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=info), timeout=5
        )

    channel = grpc.insecure_channel(address)
    yield service, address, register
    channel.close()
    for server in servers:
        server.stop(grace=0)


def test_cancelled_failed_and_finished_requests_are_each_counted(router):
    service, address, register = router
    with Client(address) as client:
        register("d", "decode")
        register("p", "prefill")
        assert client.generate([1], max_tokens=2).finish_reason == "length"
        for _ in range(3):  # the client walks away mid-stream, three times
            stream = client.stream([1], max_tokens=2)
            next(stream)
            stream.close()
        deadline = time.monotonic() + 5
        while outcomes(service).get("cancelled", 0) < 3:
            assert time.monotonic() < deadline, outcomes(service)
            time.sleep(0.02)
    got = outcomes(service)
    assert got["length"] == 1 and got["cancelled"] == 3, got


def test_a_request_the_router_gives_up_on_is_counted_by_its_status(router):
    from pdserve.client import Unavailable

    service, address, _ = router
    with Client(address) as client, pytest.raises(Unavailable):
        client.generate([1], max_tokens=2)  # no worker registers within the queue timeout
    assert outcomes(service) == {"failed_unavailable": 1.0}


def test_a_forgotten_workers_kv_series_leaves_metrics():
    from prometheus_client import generate_latest

    service = RouterService(RouterConfig(max_model_len=64, forget_after_s=0.2), 100, None)
    server, port = start_server(
        lambda srv: rpc.add_DecodeServicer_to_server(SlowDecode(), srv), "127.0.0.1", 0
    )
    info = pb.WorkerInfo(
        worker_id="d-gone",
        role="decode",
        address=f"127.0.0.1:{port}",
        total_blocks=8,
        free_blocks=2,
    )
    service.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=info), None)
    server.stop(grace=0)
    text = generate_latest(service.metrics.registry).decode()
    assert 'pdserve_router_kv_usage_ratio{worker="d-gone"} 0.75' in text
    deadline = time.monotonic() + 5
    while "d-gone" in generate_latest(service.metrics.registry).decode():
        assert time.monotonic() < deadline, "the series of a forgotten worker stayed"
        service.registry.alive("decode")  # the registry forgets on its reads
        time.sleep(0.05)


class FrozenDecode(SlowDecode):
    """Accepts the connection, never answers Reserve in time (a SIGSTOPped worker)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def Reserve(self, request, context):
        self.asked += 1
        time.sleep(1.0)
        return super().Reserve(request, context)


def test_a_frozen_decode_worker_is_skipped_after_its_first_timeout(router):
    """It has the most headroom, so the first request tries it; that request is served by
    the other worker after the Reserve timeout, and no later request tries it again until
    it heartbeats (9 requests in a row used to go to an idle frozen worker)."""
    service, address, register = router
    frozen = FrozenDecode()
    register("d-frozen", "decode", headroom=100, servicer=frozen)
    register("d-ok", "decode", headroom=10)
    register("p", "prefill")
    with Client(address) as client:
        for _ in range(4):
            result = client.generate([1], max_tokens=2)
            assert result.finish_reason == "length"
            assert result.timings["decode_worker"] == "d-ok"
    assert frozen.asked == 1
    assert "d-frozen" not in [w.worker_id for w in service.registry.decode_order()]
    records = {r.worker_id: r for r, _ in service.registry.listing()}  # still listed
    service.registry.upsert(records["d-frozen"])  # its next heartbeat, same address
    assert [w.worker_id for w in service.registry.decode_order()][0] == "d-frozen"


def test_a_handoff_that_ends_without_its_final_message_fails_internal(router, monkeypatch):
    """Never a silent end: the client holds one token and no final message, so the router
    answers INTERNAL (a bug of its own) instead of closing the stream OK."""
    service, address, _ = router

    def truncated(arrival, context):
        yield pb.GenerateResponse(request_id=arrival.request_id, token_ids=[7])

    monkeypatch.setattr(service.handoff, "serve", truncated)
    with Client(address) as client:
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for msg in client.messages([1], max_tokens=2):
                got.extend(msg.token_ids)
    assert e.value.code() == grpc.StatusCode.INTERNAL and got == [7]
    assert outcomes(service) == {"failed_internal": 1.0}


class RecordingDecode(SlowDecode):
    """Records every Release: whether the router said no push of it can land."""

    def __init__(self) -> None:
        super().__init__()
        self.unpushed: list[tuple[str, bool]] = []

    def Release(self, request, context):
        self.unpushed.append((request.request_id, request.unpushed))
        return super().Release(request, context)


class FailingOncePrefill(FakePrefill):
    """Fails its first Prefill with `code`, its trailers saying no WRITE was posted or not
    (prefill/service.py), then serves."""

    def __init__(self, code, unposted: bool) -> None:
        self.code, self.unposted, self.calls = code, unposted, 0

    def Prefill(self, request, context):
        self.calls += 1
        if self.calls == 1:
            if self.unposted:
                context.set_trailing_metadata(((UNPOSTED_KEY, "1"),))
            context.abort(self.code, "prefill failed: the forward pass failed")
        return super().Prefill(request, context)

    def Health(self, request, context):  # the router asks after a silent-looking failure
        return health("prefill", "p")


@pytest.mark.parametrize("unposted", [True, False], ids=["unposted", "posted"])
@pytest.mark.parametrize("code", ["ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"])
# a Reserve that took the fixture's 0.3 s on a busy CI machine made the only decode worker
# suspect, and the resumed request failed RESOURCE_EXHAUSTED instead (one CI run in many):
# this test is about the prefill failure, so its Reserve calls get time to answer
@pytest.mark.parametrize("router", [{"reserve_rpc_timeout_s": 5.0}], indirect=True)
def test_a_failed_prefill_that_posted_nothing_frees_its_reservation_unfenced(
    router, code, unposted
):
    """The reservation of a prefill that failed is released with `unpushed` (freed at once
    on the decode worker) exactly when the prefill worker said no WRITE of it was posted;
    otherwise it stays fenced for the push window. ABORTED (the push failed) is resumed
    at once; after a silent-looking status the prefill worker is suspect until it
    heartbeats again, so here (it never does) the request fails UNAVAILABLE."""
    from pdserve.client import Unavailable

    service, address, register = router
    decode, prefill = (
        RecordingDecode(),
        FailingOncePrefill(getattr(grpc.StatusCode, code), unposted),
    )
    register("d", "decode", servicer=decode)
    register("p", "prefill", servicer=prefill)
    with Client(address) as client:
        if code == "ABORTED":
            result = client.generate([1], max_tokens=2)
            assert result.finish_reason == "length" and result.timings["resumes"] == 1
        else:
            with pytest.raises(Unavailable, match="no prefill worker answers"):
                client.generate([1], max_tokens=2)
    deadline = time.monotonic() + 5
    while not decode.unpushed:  # released in the background
        assert time.monotonic() < deadline, "the failed attempt's reservation was never released"
        time.sleep(0.01)
    assert decode.unpushed[0][1] is unposted, decode.unpushed


class FullAfterABreak(SlowDecode):
    """Streams one token, then the stream breaks (ABORTED: the router resumes it); then
    refuses every Reserve (no room) for `full_s`, as a pool whose blocks a failed attempt
    left fenced, then serves."""

    def __init__(self, full_s: float) -> None:
        super().__init__()
        self.full_s, self.broke_at, self.refused = full_s, None, 0

    def Reserve(self, request, context):
        if self.broke_at is not None and time.monotonic() < self.broke_at + self.full_s:
            self.refused += 1
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
        return super().Reserve(request, context)

    def Start(self, request, context):
        if self.broke_at is None:
            yield pb.TokenChunk(token_ids=[1])
            self.broke_at = time.monotonic()
            context.abort(grpc.StatusCode.ABORTED, "the stream broke")
        yield pb.TokenChunk(token_ids=[2])
        yield pb.TokenChunk(finished=True, finish_reason="length")


def test_a_resumed_request_waits_for_room_longer_than_a_new_one(router):
    """A request already streaming waits for room at least the push window (blocks its
    failed attempt left fenced come back within it), not the queue timeout a new request
    gets (0.5 s here): it finishes with its tokens instead of RESOURCE_EXHAUSTED."""
    from pdserve.client import Overloaded

    service, address, register = router
    assert service.config.room_wait_s(True) >= service.config.push_window_s > 1.5
    decode = FullAfterABreak(full_s=1.5)
    register("d", "decode", servicer=decode)
    register("p", "prefill")
    with Client(address) as client:
        result = client.generate([1], max_tokens=2)
        assert result.token_ids == [1, 2] and result.timings["resumes"] == 1
        assert decode.refused > 0  # it did wait, past the 0.5 s a new request gets
        decode.broke_at = time.monotonic()  # full again: a new request waits 0.5 s only
        with pytest.raises(Overloaded, match="within 0.5s"):
            client.generate([1], max_tokens=2)


class LocalRecordingDecode(RecordingDecode):
    """Records, by prompt length, each Reserve's push window and each Start's prefill_here,
    and every Release by prompt length too."""

    def __init__(self) -> None:
        super().__init__()
        self.length: dict[str, int] = {}
        self.windows: dict[int, float] = {}
        self.here: dict[int, bool] = {}

    def Reserve(self, request, context):
        n = self.length[request.request_id] = len(request.prompt_token_ids)
        self.windows[n] = request.push_window_s
        return super().Reserve(request, context)

    def Start(self, request, context):
        self.here[self.length[request.request_id]] = request.prefill_here
        yield from super().Start(request, context)

    def released_unpushed(self, n: int) -> bool:
        return any(self.length[rid] == n and unpushed for rid, unpushed in self.unpushed)


class CountingPrefill(FakePrefill):
    def __init__(self) -> None:
        self.calls: list[int] = []

    def Prefill(self, request, context):
        self.calls.append(len(request.prompt_token_ids))
        return super().Prefill(request, context)


@pytest.mark.parametrize("router", [{"local_prefill_tokens": 4}], indirect=True)
def test_short_prompts_go_to_the_decode_worker_with_no_push_window(router):
    """Conditional disaggregation at the router: a prompt of at most 4 tokens is reserved
    with a push window of a millisecond (no push will come), started with prefill_here, never
    sent to a prefill worker, and released unfenced when its client walks away; a longer
    one goes the usual way."""
    from pdserve.router.handoff import LOCAL_PUSH_WINDOW_S

    service, address, register = router
    decode, prefill = LocalRecordingDecode(), CountingPrefill()
    register("d", "decode", servicer=decode)
    register("p", "prefill", servicer=prefill)
    with Client(address) as client:
        assert client.generate([1, 2, 3, 4], max_tokens=2).finish_reason == "length"
        assert client.generate([1, 2, 3, 4, 5], max_tokens=2).finish_reason == "length"
        stream = client.stream([7], max_tokens=50)
        next(stream)
        stream.close()
    deadline = time.monotonic() + 5
    while not decode.released_unpushed(1):  # released in the background
        assert time.monotonic() < deadline, f"not released unfenced: {decode.unpushed}"
        time.sleep(0.01)
    assert decode.here == {4: True, 5: False, 1: True}
    assert decode.windows[4] == decode.windows[1] == LOCAL_PUSH_WINDOW_S
    assert decode.windows[5] == service.config.push_window_s
    assert prefill.calls == [5]
    assert service.metrics.local_prefills._value.get() == 2


class SlowReleaseDecode(SlowDecode):
    """Answers Release a second late (a worker freezing); records when each came."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s, self.asked = delay_s, []

    def Release(self, request, context):
        self.asked.append((request.request_id, time.monotonic()))
        time.sleep(self.delay_s)
        return pb.AbortResponse(found=False)


def test_releases_to_a_frozen_worker_do_not_hold_up_another_workers(router):
    """The router tells a worker to release without waiting for its answer: releases to a
    frozen worker (each held a thread of a pool of 8 for its whole timeout) used to queue a
    healthy worker's release behind them, its blocks fenced meanwhile."""
    service, _, register = router
    frozen, healthy = SlowReleaseDecode(1.0), SlowReleaseDecode(0.0)
    register("d-frozen", "decode", servicer=frozen)
    register("d-ok", "decode", servicer=healthy)
    handoff = service.handoff
    sent = time.monotonic()
    for i in range(24):
        handoff.release_later(service.registry.find("d-frozen", "decode"), f"f{i}")
    handoff.release_later(service.registry.find("d-ok", "decode"), "ok")
    assert time.monotonic() - sent < 0.5  # nothing waited for an answer
    deadline = time.monotonic() + 5
    while not healthy.asked:
        assert time.monotonic() < deadline, "the healthy worker was never told"
        time.sleep(0.01)
    assert healthy.asked[0][0] == "ok" and healthy.asked[0][1] - sent < 0.5
    while len(frozen.asked) < 24:  # and every one of the frozen worker's was sent
        assert time.monotonic() < deadline + 5, f"{len(frozen.asked)} of 24 reached it"
        time.sleep(0.05)
