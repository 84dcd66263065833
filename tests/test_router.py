"""The router on its own, in this process: its registry's choices (exact expectations), and
its gRPC service against fake workers (real gRPC servers on 127.0.0.1 that answer like a
decode or prefill worker would, and record what they were asked)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pdserve.client import Client
from pdserve.router.config import RouterConfig
from pdserve.router.registry import WorkerRecord, WorkerRegistry
from pdserve.router.service import RouterService
from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.registration import WorkerStats
from pdserve.serving.server import start_server

# heartbeats never come in these tests: keep registered workers alive for a minute
CONFIG = RouterConfig(max_model_len=4096, queue_timeout_s=2.0, missed_heartbeats=60)


def record(wid: str, role: str, **stats) -> WorkerRecord:
    base = {"free_blocks": 64, "total_blocks": 64}
    return WorkerRecord(wid, role, "127.0.0.1:1", "", WorkerStats(**{**base, **stats}))


def test_decode_choice_subtracts_what_this_router_reserved_in_the_same_unit():
    reg = WorkerRegistry(CONFIG)
    reg.upsert(record("a", "decode", headroom_blocks=10))
    reg.upsert(record("b", "decode", headroom_blocks=8))
    a = reg.decode_order()[0]
    assert [w.worker_id for w in reg.decode_order()] == ["a", "b"]
    reg.reserved(a, 6)  # a reservation that projects 6 blocks of a's headroom
    assert [w.worker_id for w in reg.decode_order()] == ["b", "a"]
    reg.upsert(record("a", "decode", headroom_blocks=10))  # a heartbeat: fresh numbers
    assert [w.worker_id for w in reg.decode_order()] == ["a", "b"]


def test_reserves_on_their_way_spread_a_burst_over_equal_workers():
    reg = WorkerRegistry(CONFIG)
    for name in ("a", "b", "c"):
        reg.upsert(record(name, "decode", headroom_blocks=64))
    # three requests pick before any Reserve has answered: one each, not three on "a"
    picks = [reg.pick_decode(set()) for _ in range(3)]
    assert sorted(w.worker_id for w in picks) == ["a", "b", "c"]
    reg.reserved(picks[0], 4)  # answered: 4 blocks of its headroom taken
    reg.not_reserved(picks[1])  # refused: it counts no more
    # rooms now: picks[1] 64 (none on the way), picks[2] 64 (one on the way), picks[0] 60
    order = [w.worker_id for w in reg.decode_order()]
    assert order == [picks[1].worker_id, picks[2].worker_id, picks[0].worker_id]
    assert reg.pick_decode({"a", "b", "c"}) is None


def test_prefill_choice_counts_prompts_sent_since_the_heartbeat():
    reg = WorkerRegistry(CONFIG)
    reg.upsert(record("p0", "prefill", queued_tokens=0))
    reg.upsert(record("p1", "prefill", queued_tokens=5))
    picks = [reg.pick_prefill(n).worker_id for n in (10, 3, 1, 7)]
    # p0: 0 -> 10; p1: 5 -> 8; p1 (8 < 10) -> 9; p1 (9 < 10) -> 16
    assert picks == ["p0", "p1", "p1", "p1"]
    assert WorkerRegistry(CONFIG).pick_prefill(1) is None


def test_pending_counts_are_exact_under_concurrent_reservations():
    reg = WorkerRegistry(CONFIG)
    reg.upsert(record("a", "decode", headroom_blocks=0))
    worker = reg.decode_order()[0]

    def reserve_many():
        for _ in range(2000):
            reg.reserved(worker, 1)

    threads = [threading.Thread(target=reserve_many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert worker.pending_blocks == 16000


def test_readiness_names_the_missing_roles():
    reg = WorkerRegistry(CONFIG)
    assert reg.not_ready() == "no prefill and no decode worker is registered"
    reg.upsert(record("d", "decode"))
    assert reg.not_ready() == "no prefill worker is registered"
    reg.upsert(record("p", "prefill"))
    assert reg.not_ready() == ""


# -- the service against fake workers -----------------------------------------------------


class FakeDecode(rpc.DecodeServicer):
    """Reserves one block whose projected headroom cost is `cost`, and streams one token."""

    def __init__(self, name: str, cost: int) -> None:
        self.name, self.cost = name, cost
        self.reserved: list[str] = []

    def Reserve(self, request, context):
        self.reserved.append(request.request_id)
        return pb.ReserveResponse(
            block_ids=[0],
            headroom_cost_blocks=self.cost,
            layout=pb.KVLayout(num_blocks=1, block_bytes=1, planes_per_layer=1),
            worker_id=self.name,
        )

    def Start(self, request, context):
        yield pb.TokenChunk(token_ids=[request.first_token])
        yield pb.TokenChunk(finished=True, finish_reason="length")

    def Release(self, request, context):
        return pb.AbortResponse(found=True)


class FakePrefill(rpc.PrefillServicer):
    def Prefill(self, request, context):
        return pb.PrefillResponse(first_token=7, worker_id="fake-prefill")


@pytest.fixture
def router():
    """A router service on a free port, fake workers on theirs; -> (router address,
    {name: fake decode}, register(name, role, headroom))."""
    servers = []

    def serve(add) -> str:
        server, port = start_server(add, "127.0.0.1", 0)
        servers.append(server)
        return f"127.0.0.1:{port}"

    service = RouterService(CONFIG, vocab_size=100, tokenizer=None)
    address = serve(lambda s: rpc.add_RouterServicer_to_server(service, s))
    stub = rpc.RouterStub(grpc.insecure_channel(address))
    decodes: dict[str, FakeDecode] = {}

    def register(name: str, role: str, headroom: int = 0, cost: int = 1) -> None:
        if role == "decode":
            decodes[name] = FakeDecode(name, cost)
            at = serve(lambda s: rpc.add_DecodeServicer_to_server(decodes[name], s))
        else:
            at = serve(lambda s: rpc.add_PrefillServicer_to_server(FakePrefill(), s))
        info = pb.WorkerInfo(
            worker_id=name, role=role, address=at, headroom_blocks=headroom, total_blocks=64
        )
        stub.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=info))

    yield address, decodes, register
    for server in servers:
        server.stop(grace=0)


def test_router_subtracts_a_reservations_projected_blocks_not_its_prompt_blocks(router):
    """Two kv-aware decode workers, headroom 10 and 8. A 1-block prompt whose reservation
    projects 6 blocks (prompt plus expected growth) takes 6 of the first's 10: the next
    request must go to the other worker (routing on 10 - 1 = 9 sent it to the first again)."""
    address, decodes, register = router
    register("d-a", "decode", headroom=10, cost=6)
    register("d-b", "decode", headroom=8, cost=6)
    register("p", "prefill")
    client = Client(address)
    first = client.generate([1, 2, 3], max_tokens=4)
    second = client.generate([1, 2, 3], max_tokens=4)
    assert first.token_ids == second.token_ids == [7]
    assert decodes["d-a"].reserved == [first.request_id]
    assert decodes["d-b"].reserved == [second.request_id]
    client.close()


def test_router_is_not_ready_until_both_roles_register_and_early_requests_wait(router):
    address, decodes, register = router
    stub = rpc.RouterStub(grpc.insecure_channel(address))
    health = stub.Health(pb.Empty(), timeout=5)
    assert not health.ok and health.reason == "no prefill and no decode worker is registered"
    results = []
    early = threading.Thread(
        target=lambda: results.append(Client(address).generate([1, 2], max_tokens=4).token_ids)
    )
    early.start()  # arrives before any worker
    time.sleep(0.3)  # a negative check: it must still be waiting after a while, not failed
    assert early.is_alive() and not results
    register("d", "decode", headroom=10)
    assert stub.Health(pb.Empty(), timeout=5).reason == "no prefill worker is registered"
    register("p", "prefill")
    early.join(timeout=10)
    assert results == [[7]]
    assert stub.Health(pb.Empty(), timeout=5).ok


def test_without_workers_a_request_fails_unavailable_after_the_queue_timeout(router):
    from pdserve.client import Unavailable

    address, _, _ = router
    started = time.monotonic()
    with pytest.raises(Unavailable, match="no prefill and no decode worker is registered"):
        Client(address).generate([1, 2], max_tokens=4)
    assert time.monotonic() - started >= CONFIG.queue_timeout_s


@pytest.mark.parametrize("projected", [-7, 0, 12, None])
def test_a_heartbeats_projection_reaches_the_registry_as_sent(projected):
    """Negative, zero and positive projections arrive as sent; one never sent (a worker that
    does not report it) stays None, not a 0 that would read as 'full'."""
    from pdserve.router.service import check_worker_info, record_from_proto, record_to_proto
    from pdserve.serving.convert import worker_info

    base = pb.WorkerInfo(worker_id="d", role="decode", address="127.0.0.1:5")
    sent = WorkerStats(free_blocks=3, total_blocks=8, projected_free_blocks=projected)
    info = worker_info(base, sent)
    check_worker_info(info)
    record = record_from_proto(info)
    assert record.stats == sent
    assert record_from_proto(record_to_proto(record, 0.5)).stats == sent
    info.projected_free_blocks = 2**31 - 1
    with pytest.raises(ValueError, match="projected_free_blocks"):
        check_worker_info(info)


class OneAtATime(FakeDecode):
    """Room for one request: Reserve is refused (RESOURCE_EXHAUSTED) while one holds it,
    and a request's stream ends when the test sets its event in `go`."""

    def __init__(self, name: str) -> None:
        super().__init__(name, 1)
        self.lock = threading.Lock()
        self.holder: str | None = None
        self.refused: list[str] = []  # who asked and was refused, in order
        self.go: dict[str, threading.Event] = {}

    def Reserve(self, request, context):
        with self.lock:
            if self.holder is not None:
                self.refused.append(request.request_id)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
            self.holder = request.request_id
            self.go[request.request_id] = threading.Event()
        return super().Reserve(request, context)

    def Start(self, request, context):
        self.go[request.request_id].wait(30)
        yield pb.TokenChunk(token_ids=[request.first_token])
        with self.lock:
            self.holder = None  # its blocks are free before the router hears it ended
        yield pb.TokenChunk(finished=True, finish_reason="length")


def test_requests_waiting_for_room_are_served_in_turn_and_woken_when_room_is_back():
    """Four requests for a decode worker with room for one: they reserve in arrival order,
    only the line's head asks while it waits, and it asks again as soon as the request
    ahead ends (a kick), not after its pause: the pause here is 5 s, the run about 1 s."""
    config = RouterConfig(
        max_model_len=4096, queue_timeout_s=30.0, missed_heartbeats=60, reserve_retry_s=(5, 5)
    )
    service = RouterService(config, vocab_size=100, tokenizer=None)
    servers = []
    try:
        for add in (lambda s: rpc.add_RouterServicer_to_server(service, s),):
            server, port = start_server(add, "127.0.0.1", 0)
            servers.append(server)
        address = f"127.0.0.1:{port}"
        decode = OneAtATime("d")
        stub = rpc.RouterStub(grpc.insecure_channel(address))
        for name, role, add in (
            ("d", "decode", lambda s: rpc.add_DecodeServicer_to_server(decode, s)),
            ("p", "prefill", lambda s: rpc.add_PrefillServicer_to_server(FakePrefill(), s)),
        ):
            server, port = start_server(add, "127.0.0.1", 0)
            servers.append(server)
            info = pb.WorkerInfo(
                worker_id=name, role=role, address=f"127.0.0.1:{port}", total_blocks=64
            )
            stub.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=info))

        line = service.handoff.line
        results: dict[str, list[int]] = {}
        names = ["a", "b", "c", "d"]

        def send(rid: str) -> None:
            results[rid] = Client(address).generate([1, 2], max_tokens=2, request_id=rid).token_ids

        def until(condition, what: str) -> None:
            deadline = time.monotonic() + 10
            while not condition():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                time.sleep(0.005)

        threads = []
        for i, rid in enumerate(names):
            threads.append(threading.Thread(target=send, args=(rid,)))
            threads[-1].start()
            if i == 0:
                until(lambda: decode.holder == "a", "a to reserve")
            elif i == 1:
                until(lambda: decode.refused == ["b"], "b to be refused")
            else:
                until(lambda n=i: len(line) == n, f"{rid} to join the line")
        started = time.monotonic()
        for rid in names:
            until(lambda r=rid: decode.holder == r, f"{rid} to reserve")
            decode.go[rid].set()
        for t in threads:
            t.join(timeout=10)
        assert results == {rid: [7] for rid in names}
        assert decode.reserved == names  # first come, first served
        # only the head asked while the line was closed: b until it got in, then c, then d
        assert decode.refused == sorted(decode.refused) and decode.refused[0] == "b"
        assert time.monotonic() - started < 4.0  # kicked each time, never a 5 s pause
        assert len(line) == 0
    finally:
        for server in servers:
            server.stop(grace=0)


def test_an_id_that_ended_lately_gets_its_own_workers_id_until_the_window_passes():
    """A client that cancels and sends again under the same id: the workers may still hold
    the old request under it, so the new one's first attempt is tagged; so is a continued
    one's always; an id not seen lately (or seen long ago) is used as it is."""
    from pdserve.router.request import RecentIds

    class Clock:
        t = 1000.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    recent = RecentIds(keep_s=60.0, clock=clock)
    assert recent.worker_id("a", continued=False) == ""
    recent.ended("a")
    tagged = recent.worker_id("a", continued=False)
    assert tagged.startswith("a~u") and tagged != recent.worker_id("a", continued=False)
    assert recent.worker_id("b", continued=False) == ""
    assert recent.worker_id("b", continued=True).startswith("b~c")
    clock.t += 61.0
    assert recent.worker_id("a", continued=False) == "" and len(recent) == 0


def test_a_stream_that_ends_without_taking_its_pending_move_lets_the_mover_decide_at_once():
    """A move is under way (its mover waits for the old stream to end "migrated") when the
    stream fails otherwise (its worker froze past the silence window, say): the mover is
    told at once and gives the move up, instead of waiting out migrate_timeout_s (a drain
    in the chaos matrix ended 30 s late that way)."""
    from types import SimpleNamespace

    from pdserve.router.handoff import Handoff, Handover, Inflight
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.request import Arrival, Run

    class Broken(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "Socket closed"

    class Stream:
        def __iter__(self):
            raise Broken()

        def cancel(self):
            return True

    config = RouterConfig(max_model_len=64, token_feed=False)
    registry = WorkerRegistry(config)
    handoff = Handoff(config, registry, RouterMetrics(), None, {})
    record = WorkerRecord("d0", "decode", "127.0.0.1:1", "", WorkerStats(8, 8))
    released = []
    release = SimpleNamespace(  # the attempt's release: recorded, answered later
        future=lambda req, timeout: (
            released.append(req.request_id) or SimpleNamespace(add_done_callback=lambda f: None)
        )
    )
    stub = SimpleNamespace(Start=lambda start, timeout: Stream(), Release=release)
    decode = SimpleNamespace(record=record, worker_id="d0", stub=stub, suspect=False)
    arrival = Arrival("r", [1, 2, 3], pb.SamplingParams(max_tokens=8), time.monotonic(), 0.0)
    run = Run(arrival, tokens=[5])
    entry = Inflight(worker=decode, worker_request_id="r", run=run)
    entry.handover = pending = Handover(SimpleNamespace(worker_id="d1"), "r~m1", 1)
    context = SimpleNamespace(add_callback=lambda f: None, is_active=lambda: True)
    relay = handoff._relay(run, entry, context, decode, None, (0.0, 0.0, 0.0), pb.StartRequest())
    with pytest.raises(StopIteration) as ended:
        next(relay)
    assert ended.value.value.code is grpc.StatusCode.UNAVAILABLE  # resumed by recompute
    assert pending.switched.is_set() and pending.state == "moving"  # the mover's to give up
    assert released == ["r"]  # the attempt itself is released as before
    handoff.watch.close()
