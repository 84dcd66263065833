"""The router's resume loop with scripted fake workers (real gRPC servers in this process):
what the next worker is asked for after a failure, that the client's stream has every token
once and in order, which failures are not resumed, and what the client is told when resumes
run out. The "model" of the fakes: the token at position i of a sequence is i."""

from __future__ import annotations

import re
import time

import grpc
import pytest

from pdserve.client import Client, InvalidRequest, Unavailable, build_request
from pdserve.engine.admission import waiting_per_worker
from pdserve.router.config import RouterConfig
from pdserve.router.service import RouterService
from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.server import start_server

PROMPT = [11, 12, 13, 14, 15]


class Decode(rpc.DecodeServicer):
    """Streams positions; `die_after` tokens into an attempt it fails with `code`."""

    def __init__(self, die_after: int | None = None, code=grpc.StatusCode.UNAVAILABLE) -> None:
        self.die_after, self.code = die_after, code
        self.reserves: list[pb.ReserveRequest] = []
        self.released: list[str] = []

    def Reserve(self, request, context):
        self.reserves.append(request)
        return pb.ReserveResponse(block_ids=[0], fence=len(self.reserves), worker_id="d")

    def Start(self, request, context):
        reserve = next(r for r in self.reserves if r.request_id == request.request_id)
        position, left = len(reserve.prompt_token_ids), reserve.sampling.max_tokens
        token, sent = request.first_token, 0
        while True:
            if self.die_after is not None and sent == self.die_after:
                context.abort(self.code, "scripted failure")
            sent += 1
            if sent == left:  # the last token comes with the end
                yield pb.TokenChunk(token_ids=[token], finished=True, finish_reason="length")
                return
            yield pb.TokenChunk(token_ids=[token])
            position += 1
            token = position

    def Release(self, request, context):
        self.released.append(request.request_id)
        return pb.AbortResponse(found=True)


class Prefill(rpc.PrefillServicer):
    def __init__(self, fail_first: int = 0) -> None:
        self.fail_first, self.calls = fail_first, 0

    def Prefill(self, request, context):
        self.calls += 1
        if self.calls <= self.fail_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "scripted prefill failure")
        return pb.PrefillResponse(first_token=len(request.prompt_token_ids), worker_id="p")


@pytest.fixture
def cluster():
    servers, channels = [], []

    def serve(add) -> str:
        server, port = start_server(add, "127.0.0.1", 0)
        servers.append(server)
        return f"127.0.0.1:{port}"

    def make(decodes: list[Decode], prefill: Prefill | list[Prefill], max_resumes=2) -> str:
        config = RouterConfig(max_model_len=64, queue_timeout_s=2.0, max_resumes=max_resumes)
        service = RouterService(config, 100, None)
        address = serve(lambda s: rpc.add_RouterServicer_to_server(service, s))
        channel = grpc.insecure_channel(address)
        channels.append((channel, service))
        prefills = prefill if isinstance(prefill, list) else [prefill]
        workers = [("prefill", f"p{i}", p, 8) for i, p in enumerate(prefills)] + [
            ("decode", f"d{i}", d, 100 - i) for i, d in enumerate(decodes)
        ]  # d0 has the most headroom: tried first
        for role, wid, servicer, headroom in workers:
            add = (
                rpc.add_DecodeServicer_to_server
                if role == "decode"
                else rpc.add_PrefillServicer_to_server
            )
            at = serve(lambda s, add=add, servicer=servicer: add(servicer, s))
            info = pb.WorkerInfo(
                worker_id=wid, role=role, address=at, total_blocks=100, free_blocks=100,
                headroom_blocks=headroom,
            )  # fmt: skip
            rpc.RouterStub(channel).Register(
                pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=info), timeout=5
            )
        return address

    yield make
    for channel, service in channels:
        channel.close()
        service.close()
    for server in servers:
        server.stop(grace=0)


def expected(n: int) -> list[int]:
    return [len(PROMPT) + i for i in range(n)]


def test_a_decode_failure_mid_stream_resumes_with_the_context_sent(cluster):
    dying, healthy = Decode(die_after=3), Decode()
    with Client(cluster([dying, healthy], Prefill())) as client:
        result = client.generate(PROMPT, max_tokens=8, ignore_eos=True)
    assert result.token_ids == expected(8)  # every token once, in order
    assert result.timings["resumes"] == 1 and result.timings["decode_worker"] == "d1"
    (again,) = healthy.reserves
    assert list(again.prompt_token_ids) == PROMPT + expected(3)  # the prompt + what was sent
    assert again.sampling.max_tokens == 5 and again.request_id.endswith("~r1")
    assert [r.request_id for r in dying.reserves] == [again.request_id[:-3]]


def test_a_failed_prefill_is_tried_on_another_worker(cluster):
    failing, good = Prefill(fail_first=1), Prefill()
    decode = Decode()
    with Client(cluster([decode], [failing, good])) as client:
        result = client.generate(PROMPT, max_tokens=4, ignore_eos=True)
        assert result.token_ids == expected(4) and result.timings["resumes"] == 1
        assert (failing.calls, good.calls) == (1, 1)  # the failed one is suspect now
        assert client.generate(PROMPT, max_tokens=2, ignore_eos=True).token_ids == expected(2)
    assert (failing.calls, good.calls) == (1, 2)
    deadline = time.monotonic() + 5  # released from the router's release threads
    while decode.reserves[0].request_id not in decode.released:
        assert time.monotonic() < deadline, "the failed attempt was never released"
        time.sleep(0.01)


def test_when_resumes_run_out_the_client_is_told_unavailable(cluster):
    a, b = Decode(die_after=1, code=grpc.StatusCode.NOT_FOUND), Decode(die_after=1)
    with (
        Client(cluster([a, b], Prefill(), max_resumes=2)) as client,
        pytest.raises(Unavailable, match=r"after 2 resumes"),
    ):
        client.generate(PROMPT, max_tokens=8, ignore_eos=True)
    assert len(a.reserves) + len(b.reserves) == 3  # the first attempt and two resumes


def test_a_failure_no_retry_can_fix_is_not_resumed(cluster):
    bad, other = Decode(die_after=0, code=grpc.StatusCode.INVALID_ARGUMENT), Decode()
    with (
        Client(cluster([bad, other], Prefill())) as client,
        pytest.raises(InvalidRequest, match="scripted failure"),
    ):
        client.generate(PROMPT, max_tokens=4, ignore_eos=True)
    assert other.reserves == []


def _continued(tokens: list[int], max_tokens: int) -> pb.GenerateRequest:
    request = build_request(PROMPT, dict(max_tokens=max_tokens, ignore_eos=True))
    request.continuation.ids.extend(tokens)
    return request


def test_a_continuation_goes_on_after_the_tokens_the_client_has(cluster):
    """What a client sends a restarted router (pdserve/client.py): the prompt and the
    tokens it already has, which count against max_tokens and are not sent again."""
    decode = Decode()
    with grpc.insecure_channel(cluster([decode], Prefill())) as channel:
        stub = rpc.RouterStub(channel)
        messages = list(stub.Generate(_continued(expected(3), 8), timeout=10))
        new = [t for m in messages for t in m.token_ids]
        assert new == expected(8)[3:]
        (reserve,) = decode.reserves
        assert list(reserve.prompt_token_ids) == PROMPT + expected(3)
        assert reserve.sampling.max_tokens == 5
        assert reserve.request_id.startswith(f"{messages[0].request_id}~c")  # its own id there
        final = messages[-1]
        assert final.finish_reason == "length" and final.prompt_tokens == len(PROMPT)
        # everything already there: the end at once, no worker asked
        (done,) = list(stub.Generate(_continued(expected(8), 8), timeout=10))
        assert done.finished and done.finish_reason == "length" and not done.token_ids
        assert len(decode.reserves) == 1
        for bad, field in ((expected(9), "more than max_tokens"), ([100], r"continuation\[0\]")):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(_continued(bad, 8), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert re.search(field, e.value.details())


def test_each_reserve_says_how_long_the_routers_line_is(cluster):
    """Cost-aware admission reads it: past the expected peak only with no line."""
    first, second = Decode(), Decode()
    with Client(cluster([first, second], Prefill())) as client:
        client.generate(PROMPT, max_tokens=2, ignore_eos=True)
    (reserve,) = first.reserves  # the most headroom: asked first, and it said yes
    assert (reserve.line, reserve.decode_workers) == (1, 2)  # this request alone, 2 workers
    assert waiting_per_worker(reserve.line, reserve.decode_workers) == 0.5
    # a Reserve that does not say (a migration's, an older router's): not known
    for unsaid in (pb.ReserveRequest(request_id="x"), pb.ReserveRequest(line=3)):
        assert waiting_per_worker(unsaid.line, unsaid.decode_workers) is None
