"""The doors (pdserve/serving/auth.py): the cluster secret on internal RPCs, API keys on the
public ones, request ownership, mutual TLS. Real gRPC servers on free ports in this process;
real decode and prefill workers where "changes nothing" is about their pools."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from workers import decode_worker, prefill_worker

from decode.service import DecodeService
from pdserve.client import Client, InvalidRequest, Unauthorized, Unavailable
from pdserve.engine.args import EngineArgs
from pdserve.router.config import RouterConfig
from pdserve.router.service import RouterService
from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving import auth
from pdserve.serving.auth import TLS, Security
from pdserve.serving.server import start_server
from prefill.service import PrefillService

SECRET = "s3cret-for-this-test-only"
KEY_A, KEY_B = "key-a-123", "key-b-456"
ROUTER = Security(cluster_secret=SECRET, api_keys=(KEY_A, KEY_B))
MEMBER = Security(cluster_secret=SECRET)
TOKENS = 12  # the slow fake decode streams this many, one per TICK_S
TICK_S = 0.05


class SlowDecode(rpc.DecodeServicer):
    """Streams TOKENS tokens, one per tick, until released."""

    def __init__(self) -> None:
        self.released: dict[str, threading.Event] = {}

    def Reserve(self, request, context):
        self.released[request.request_id] = threading.Event()
        return pb.ReserveResponse(block_ids=[0], worker_id="slow-decode", headroom_cost_blocks=1)

    def Start(self, request, context):
        released = self.released[request.request_id]
        for i in range(TOKENS):
            if released.wait(TICK_S):
                yield pb.TokenChunk(finished=True, finish_reason="abort")
                return
            yield pb.TokenChunk(token_ids=[i + 1])
        yield pb.TokenChunk(finished=True, finish_reason="length")

    def Release(self, request, context):
        event = self.released.get(request.request_id)
        if event is not None:
            event.set()
        return pb.AbortResponse(found=event is not None)


class FakePrefill(rpc.PrefillServicer):
    def Prefill(self, request, context):
        return pb.PrefillResponse(first_token=0, worker_id="fake-prefill")


@pytest.fixture
def cluster():
    """A router with a secret and two API keys, a slow fake decode and a fake prefill worker
    behind the same secret, registered -> router address."""
    servers = []

    def serve(add, security) -> str:
        server, port = start_server(add, "127.0.0.1", 0, security=security)
        servers.append(server)
        return f"127.0.0.1:{port}"

    service = RouterService(RouterConfig(max_model_len=64), 100, None, ROUTER)
    address = serve(lambda s: rpc.add_RouterServicer_to_server(service, s), ROUTER)
    decode = serve(lambda s: rpc.add_DecodeServicer_to_server(SlowDecode(), s), MEMBER)
    prefill = serve(lambda s: rpc.add_PrefillServicer_to_server(FakePrefill(), s), MEMBER)
    with auth.channel(address, MEMBER) as channel:
        stub = rpc.RouterStub(channel)
        for wid, role, at in (("d", "decode", decode), ("p", "prefill", prefill)):
            info = pb.WorkerInfo(
                worker_id=wid, role=role, address=at, total_blocks=8, free_blocks=8
            )
            stub.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=info))
    yield address
    for server in servers:
        server.stop(grace=0)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def _listing(address: str) -> list[tuple[str, str]]:
    with Client(address, security=MEMBER) as c:
        return sorted((w.worker_id, w.address) for w in c.workers())


def test_register_without_the_secret_is_refused_and_changes_nothing(cluster):
    before = _listing(cluster)
    fake = pb.WorkerInfo(worker_id="p", role="prefill", address="127.0.0.1:9", total_blocks=1)
    request = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=fake)
    for security, code in (
        (Security(), grpc.StatusCode.UNAUTHENTICATED),
        (Security(cluster_secret="x" * 24), grpc.StatusCode.UNAUTHENTICATED),
        (Security(api_key=KEY_A), grpc.StatusCode.PERMISSION_DENIED),  # a client, not a member
    ):
        with auth.channel(cluster, security) as channel:
            assert _code(lambda: rpc.RouterStub(channel).Register(request, timeout=5)) == code
    assert _listing(cluster) == before  # the real "p" is still there, at its own address


def test_a_member_cannot_register_impossible_stats(cluster):
    """A fake prefill advertising queued_tokens=-1e9 would attract every request."""
    with auth.channel(cluster, MEMBER) as channel:
        stub = rpc.RouterStub(channel)
        for bad in (
            dict(queued_tokens=-1_000_000_000),
            dict(free_blocks=5, total_blocks=1),
            dict(address="nowhere"),
            dict(role="admin"),
            dict(worker_id=""),
        ):
            info = {"worker_id": "p2", "role": "prefill", "address": "127.0.0.1:9", **bad}
            request = pb.RegisterRequest(
                protocol_version=PROTOCOL_VERSION, worker=pb.WorkerInfo(**info)
            )
            with pytest.raises(grpc.RpcError) as e:
                stub.Register(request, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("worker."), e.value.details()
    assert "p2" not in {wid for wid, _ in _listing(cluster)}


def test_api_keys_guard_generate_and_list_workers(cluster):
    for security in (Security(), Security(api_key="wrong-key")):
        with Client(cluster, security=security) as c:
            with pytest.raises(Unauthorized, match="UNAUTHENTICATED"):
                c.generate([1, 2], max_tokens=2)
            with pytest.raises(Unauthorized):
                c.workers()
            assert c.health().role == "router"  # Health stays open
    with Client(cluster, api_key=KEY_B) as c:
        assert c.generate([1, 2], max_tokens=2).token_ids == list(range(1, TOKENS + 1))


def test_router_assigned_ids_are_random(cluster):
    with Client(cluster, api_key=KEY_A) as c:
        ids = {c.generate([1], max_tokens=1).request_id for _ in range(3)}
    assert len(ids) == 3
    assert all(i.startswith("req-") and len(i) == 4 + 32 for i in ids), ids


def test_another_callers_abort_is_refused_and_the_stream_completes(cluster):
    owner, stranger = Client(cluster, api_key=KEY_A), Client(cluster, api_key=KEY_B)
    stream = owner.stream([1], max_tokens=2, request_id="mine")
    tokens = [next(stream)]  # the request is running now
    assert stranger.abort("mine") is False
    with Client(cluster, security=Security()) as anonymous, pytest.raises(Unauthorized):
        anonymous.abort("mine")
    tokens += list(stream)
    assert tokens == list(range(1, TOKENS + 1))  # nothing cut the stream short
    assert not owner.abort("mine")  # over: nothing to abort
    owner.close()
    stranger.close()


@pytest.mark.parametrize("aborter", [Security(api_key=KEY_A), MEMBER], ids=["owner", "member"])
def test_the_owner_and_a_member_can_abort(cluster, aborter):
    owner, aborting = Client(cluster, api_key=KEY_A), Client(cluster, security=aborter)
    results = []
    run = threading.Thread(
        target=lambda: results.append(owner.generate([1], max_tokens=2, request_id="r"))
    )
    run.start()
    deadline = time.monotonic() + 5
    while not aborting.abort("r"):
        assert time.monotonic() < deadline and run.is_alive(), "never abortable"
        time.sleep(0.01)
    run.join(timeout=10)
    assert results[0].finish_reason == "abort"
    assert len(results[0].token_ids) < TOKENS
    owner.close()
    aborting.close()


def test_a_duplicate_id_is_refused_the_same_way_whoever_owns_the_first(cluster):
    owner = Client(cluster, api_key=KEY_A)
    stream = owner.stream([1], max_tokens=2, request_id="dup")
    next(stream)  # the first request holds the id now
    messages = []
    for key in (KEY_A, KEY_B):
        with Client(cluster, api_key=key) as c, pytest.raises(InvalidRequest) as e:
            c.generate([1], max_tokens=2, request_id="dup")
        messages.append(str(e.value))
    assert messages == ["ALREADY_EXISTS: request_id: already in use"] * 2
    assert len(list(stream)) == TOKENS - 1  # the first one is untouched
    with Client(cluster, api_key=KEY_B) as c:  # and the id is free again once it ended
        assert c.generate([1], max_tokens=2, request_id="dup").finish_reason == "length"
    owner.close()


SHUTDOWNS: list[str] = []  # the decode worker's Shutdown calls that got through


@pytest.fixture(scope="module")
def workers():
    """A real decode and a real prefill worker behind the secret -> (decode, prefill,
    decode address, prefill address)."""
    args = EngineArgs(block_size=16, num_kv_blocks=8)
    decode = decode_worker("tiny-llama", "d-auth", "nixl", args)
    prefill = prefill_worker("tiny-llama", "p-auth", "nixl", args)
    servers = []
    addresses = []
    for add in (
        lambda s: rpc.add_DecodeServicer_to_server(
            DecodeService(decode, on_shutdown=lambda: SHUTDOWNS.append("d-auth")), s
        ),
        lambda s: rpc.add_PrefillServicer_to_server(PrefillService(prefill), s),
    ):
        server, port = start_server(add, "127.0.0.1", 0, security=MEMBER)
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    yield decode, prefill, *addresses
    for server in servers:
        server.stop(grace=0)
    decode.close()
    prefill.close()


def test_internal_rpcs_without_the_secret_are_refused_and_change_nothing(workers):
    decode, prefill, decode_at, prefill_at = workers
    sampling = pb.SamplingParams(max_tokens=4, top_p=1.0)
    reserve = pb.ReserveRequest(
        request_id="r1", prompt_token_ids=[1, 2, 3], sampling=sampling, lease_s=30
    )
    with auth.channel(decode_at, MEMBER) as channel:
        held = rpc.DecodeStub(channel).Reserve(reserve, timeout=10)  # a member's reservation
    free = decode.stats().free_blocks
    push = pb.PrefillRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=sampling,
        dest_block_ids=held.block_ids,
        dest_layout=held.layout,
        dest_agent_metadata=held.agent_metadata,
    )
    for security in (Security(), Security(cluster_secret="not-the-secret-at-all")):
        with auth.channel(decode_at, security) as d, auth.channel(prefill_at, security) as p:
            stub, prefill_stub = rpc.DecodeStub(d), rpc.PrefillStub(p)
            calls = (
                lambda s=stub: s.Reserve(reserve, timeout=5),
                lambda s=stub: list(s.Start(pb.StartRequest(request_id="r1"), timeout=5)),
                lambda s=stub: s.Release(pb.AbortRequest(request_id="r1"), timeout=5),
                lambda s=prefill_stub: s.Prefill(push, timeout=5),
                lambda s=stub: s.Shutdown(pb.Empty(), timeout=5),
            )
            assert [_code(call) for call in calls] == [grpc.StatusCode.UNAUTHENTICATED] * 5
            assert stub.Health(pb.Empty(), timeout=5).ok  # Health stays open
    assert decode.stats().free_blocks == free  # nothing reserved, nothing released
    assert prefill.stats().queued_tokens == 0 and SHUTDOWNS == []  # and nothing stopped
    with auth.channel(decode_at, MEMBER) as channel:  # a member may stop it
        rpc.DecodeStub(channel).Shutdown(pb.Empty(), timeout=5)
    assert SHUTDOWNS == ["d-auth"]
    with auth.channel(decode_at, MEMBER) as channel:
        assert rpc.DecodeStub(channel).Release(pb.AbortRequest(request_id="r1"), timeout=5).found
    decode.check_integrity()


def test_heartbeats_with_a_wrong_secret_never_register(cluster, caplog):
    from pdserve.serving.registration import Registration, WorkerStats

    def info(worker_id: str) -> pb.WorkerInfo:
        return pb.WorkerInfo(worker_id=worker_id, role="decode", address="127.0.0.1:9")

    stats = lambda: WorkerStats(free_blocks=8, total_blocks=8, headroom_blocks=8)  # noqa: E731
    # the router asks a new worker for its Health first: "ok" needs a server that answers
    server, port = start_server(
        lambda srv: rpc.add_DecodeServicer_to_server(SlowDecode(), srv), "127.0.0.1", 0
    )
    ok_info = pb.WorkerInfo(worker_id="ok", role="decode", address=f"127.0.0.1:{port}")
    wrong = Registration(cluster, info("intruder"), stats, Security(cluster_secret="y" * 20))
    right = Registration(cluster, ok_info, stats, MEMBER)
    deadline = time.monotonic() + 10
    while "ok" not in {wid for wid, _ in _listing(cluster)} or "UNAUTHENTICATED" not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.05)
    assert "intruder" not in {wid for wid, _ in _listing(cluster)}
    assert "y" * 20 not in caplog.text
    wrong.close()
    right.close()
    server.stop(grace=0)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    from pdserve.serving.certs import make_certs

    return make_certs(tmp_path_factory.mktemp("certs"), ["127.0.0.1", "localhost"])


def test_with_tls_a_plaintext_client_is_refused_and_a_certified_one_served(certs):
    member_tls = TLS.from_files(certs["member.pem"], certs["member-key.pem"], certs["ca.pem"])
    security = Security(cluster_secret=SECRET, tls=member_tls)
    service = RouterService(RouterConfig(max_model_len=64), 100, None, security)
    server, port = start_server(
        lambda s: rpc.add_RouterServicer_to_server(service, s), "127.0.0.1", 0, security=security
    )
    address = f"127.0.0.1:{port}"
    try:
        with Client(address) as plain, pytest.raises(Unavailable):
            plain.health()  # the handshake fails
        ca_only = TLS.from_files(None, None, certs["ca.pem"])  # no client certificate
        with Client(address, tls=ca_only) as anonymous, pytest.raises(Unavailable):
            anonymous.health()
        with Client(address, tls=member_tls) as certified:
            assert certified.health().role == "router"
    finally:
        server.stop(grace=0)


def test_security_never_prints_a_credential():
    text = repr(Security(cluster_secret=SECRET, api_keys=(KEY_A,), api_key=KEY_B))
    assert SECRET not in text and KEY_A not in text and KEY_B not in text


def test_a_prompt_far_beyond_max_model_len_is_invalid_not_overloaded(cluster):
    """10M token ids (10 MB on the wire) reach validation and are refused naming `prompt`;
    one larger than the router takes is refused by the SDK itself: both can never succeed,
    so neither may read as "retry later"."""
    with Client(cluster, api_key=KEY_A) as c:
        with pytest.raises(InvalidRequest, match="INVALID_ARGUMENT: prompt: 10000000 tokens"):
            c.generate([1] * 10_000_000, max_tokens=1)
        with pytest.raises(InvalidRequest, match="prompt: the request is") as e:
            c.generate([2**21] * 17_000_000, max_tokens=1)  # 4 bytes each: 68 MB
        assert not e.value.retryable


def test_a_body_that_is_not_the_message_is_invalid_argument_not_internal(cluster):
    """gRPC answers INTERNAL ("Exception deserializing request!") by itself: that reads as
    the server's fault. A refused caller's body is not even parsed."""
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, a length no body holds
    for security, method, code in (
        (MEMBER, "/pdserve.v1.Router/Abort", grpc.StatusCode.INVALID_ARGUMENT),
        (Security(), "/pdserve.v1.Router/Health", grpc.StatusCode.INVALID_ARGUMENT),
        (Security(), "/pdserve.v1.Router/Register", grpc.StatusCode.UNAUTHENTICATED),
    ):
        with auth.channel(cluster, security) as channel:
            call = channel.unary_unary(method)  # bytes in, bytes out
            with pytest.raises(grpc.RpcError) as e:
                call(garbage, timeout=5)
            assert e.value.code() == code, (method, e.value.details())
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                assert e.value.details().startswith("request: not a valid message"), method


def test_credentials_load_from_a_file_stdin_or_the_environment(tmp_path, monkeypatch):
    import io

    from pdserve.serving.auth import load_api_keys, load_secret

    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    assert load_secret(str(secret_file), environ={}) == SECRET
    monkeypatch.setattr("sys.stdin", io.StringIO(SECRET + "\nnot this\n"))
    assert load_secret("-", environ={}) == SECRET
    environ = {"PDSERVE_CLUSTER_SECRET": SECRET, "OTHER": "x"}
    assert load_secret(None, environ) == SECRET
    assert environ == {"OTHER": "x"}  # gone: no child inherits it
    assert load_secret(None, environ={}) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="cluster secret: .*empty"):
        load_secret(str(tmp_path / "empty"), environ={})
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(str(tmp_path / "missing"), environ={})
    keys = tmp_path / "keys"
    keys.write_text("# comment\nk-one\n\nk-two\nk-one\n")
    environ = {"PDSERVE_API_KEY": "k-env"}
    assert load_api_keys(["k-flag"], str(keys), environ) == ("k-flag", "k-one", "k-two", "k-env")
    assert environ == {}
    with pytest.raises(ValueError, match="printable ASCII"):
        Security(api_keys=("ключ",))
    with pytest.raises(ValueError, match="at least 16"):
        Security(cluster_secret="short")


def test_a_worker_that_never_answers_is_not_registered(cluster):
    """Even with the secret: the router asks a new worker for its Health before routing to
    it. One that accepts TCP and never speaks (it made 4/4 following requests fail after
    10 s), and an address no one listens at, are refused, naming the address."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections (the kernel does), never answers
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
    before = _listing(cluster)
    with auth.channel(cluster, MEMBER) as channel:
        stub = rpc.RouterStub(channel)
        for sock in (silent, closed):
            at = f"127.0.0.1:{sock.getsockname()[1]}"
            info = pb.WorkerInfo(worker_id="mute", role="prefill", address=at, total_blocks=8)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                stub.Register(
                    pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=info), timeout=10
                )
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert e.value.details().startswith(f"worker.address: the router cannot reach {at}")
            assert time.monotonic() - started < 5
    assert _listing(cluster) == before
    silent.close()
    closed.close()
