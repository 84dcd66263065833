"""The SDK's side of a router restart (pdserve/client.py), against a scripted router in
this process: which endings are sent again as a continuation, and which are not."""

from __future__ import annotations

import time

import grpc
import pytest

from pdserve.client import Client, StreamEnded, Unavailable
from pdserve.rpc import ACCEPTED_KEY, STATUS_KEY
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.server import start_server


class Router(rpc.RouterServicer):
    """Generates 10, 11, 12, ... up to max_tokens; the first call ends as `script` says;
    "dies" then answers `unreached` continuations as a router not listening would."""

    def __init__(self, script: str, unreached: int = 0) -> None:
        self.script, self.calls, self.unreached = script, [], unreached

    def _unreached(self) -> bool:
        self.unreached -= 1
        return self.unreached >= 0

    def Generate(self, request, context):
        self.calls.append(request)
        first = len(self.calls) == 1
        if not first and self._unreached():
            # as a call to a router that is not listening yet ends: no mark, no status
            context.abort(grpc.StatusCode.UNAVAILABLE, "failed to connect: Connection refused")
        if not (first and self.script == "never-accepted"):
            context.send_initial_metadata(((ACCEPTED_KEY, "1"),))
        have = list(request.continuation.ids)
        tokens = [10 + i for i in range(len(have), request.sampling.max_tokens)]
        if first and self.script == "dies":  # two tokens out, then the connection breaks
            yield pb.GenerateResponse(request_id="r", token_ids=tokens[:2])
            context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        if first and self.script in ("router-status", "never-accepted"):
            if self.script == "router-status":
                context.set_trailing_metadata(((STATUS_KEY, "1"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is registered")
        if first and self.script == "cancelled":  # as a router shutting down ends a call
            yield pb.GenerateResponse(request_id="r", token_ids=tokens[:1])
            context.set_trailing_metadata(((STATUS_KEY, "1"),))
            context.abort(grpc.StatusCode.CANCELLED, "the router is shutting down")
        if first and self.script == "no-final":
            yield pb.GenerateResponse(request_id="r", token_ids=tokens)
            return
        yield pb.GenerateResponse(
            request_id="r", token_ids=tokens, finished=True, finish_reason="length"
        )
        if first and self.script == "final-then-break":
            context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")


@pytest.fixture
def router():
    servers = []

    def make(script: str, unreached: int = 0) -> tuple[Router, str]:
        servicer = Router(script, unreached)
        server, port = start_server(
            lambda s: rpc.add_RouterServicer_to_server(servicer, s), "127.0.0.1", 0
        )
        servers.append(server)
        return servicer, f"127.0.0.1:{port}"

    yield make
    for server in servers:
        server.stop(grace=0)


def test_a_router_that_vanished_gets_the_rest_as_a_continuation(router):
    servicer, address = router("dies")
    with Client(address, reconnect_timeout_s=5) as client:
        result = client.generate([1, 2, 3], max_tokens=6, ignore_eos=True)
    assert result.token_ids == [10, 11, 12, 13, 14, 15]  # none lost, none twice
    assert result.timings["reconnects"] == 1
    first, again = servicer.calls
    assert not first.HasField("continuation")
    assert list(again.continuation.ids) == [10, 11] and again.HasField("continuation")
    assert list(again.token_ids.ids) == [1, 2, 3]  # the prompt as it was


@pytest.mark.parametrize("agent", ["sync", "async"])
def test_a_continuation_that_reaches_no_router_is_sent_again_within_the_wait(router, agent):
    """After a router dies its channel can still look ready, so the continuation fails to
    connect (no accepted mark, no status of a router's own): it is sent again, within the
    same reconnect (CI once lost a stream this way in test_survival's router restart)."""
    servicer, address = router("dies", unreached=3)
    if agent == "sync":
        with Client(address, reconnect_timeout_s=5) as client:
            result = client.generate([1, 2, 3], max_tokens=6, ignore_eos=True)
    else:
        result = _agenerate(address, max_tokens=6)
    assert result.token_ids == [10, 11, 12, 13, 14, 15]
    assert result.timings["reconnects"] == 1  # one break, however many tries it took
    assert len(servicer.calls) == 5
    assert all(list(c.continuation.ids) == [10, 11] for c in servicer.calls[1:])


@pytest.mark.parametrize("agent", ["sync", "async"])
def test_a_router_that_never_comes_back_fails_the_request_when_the_wait_ends(router, agent):
    servicer, address = router("dies", unreached=10**6)
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="Connection refused"):
        if agent == "sync":
            with Client(address, reconnect_timeout_s=1) as client:
                client.generate([1, 2, 3], max_tokens=6, ignore_eos=True)
        else:
            _agenerate(address, max_tokens=6, reconnect_timeout_s=1)
    assert 1 <= time.monotonic() - t0 < 10
    assert 3 <= len(servicer.calls) <= 12  # backing off between tries, not spinning


def test_a_status_of_the_routers_own_is_not_sent_again(router):
    servicer, address = router("router-status")
    with Client(address, reconnect_timeout_s=5) as client, pytest.raises(Unavailable):
        client.generate([1, 2, 3], max_tokens=4, ignore_eos=True)
    assert len(servicer.calls) == 1


def test_a_call_no_router_took_is_sent_again_as_a_continuation_of_nothing(router):
    """A call that broke before any router took it (a router that died a moment after it
    was sent, or none listening yet) is sent again; as a continuation of nothing, so that
    the router that serves it gives it its own workers' id (the dead one may have begun
    it there)."""
    servicer, address = router("never-accepted")
    with Client(address, reconnect_timeout_s=5) as client:
        result = client.generate([1, 2, 3], max_tokens=4, ignore_eos=True)
    assert result.token_ids == [10, 11, 12, 13] and len(servicer.calls) == 2
    assert result.timings["reconnects"] == 0  # not one of the reconnects a break may need
    assert servicer.calls[1].HasField("continuation") and not servicer.calls[1].continuation.ids


def test_an_address_nobody_serves_fails_after_the_fresh_wait_not_the_reconnect_one():
    import socket

    from pdserve.client import FRESH_WAIT_S

    with socket.socket() as s:  # a port nobody listens on (bound, then freed)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with Client(f"127.0.0.1:{port}", reconnect_timeout_s=60) as c, pytest.raises(Unavailable):
        c.generate([1, 2, 3], max_tokens=4)
    assert FRESH_WAIT_S - 0.5 <= time.monotonic() - t0 < FRESH_WAIT_S + 5
    t0 = time.monotonic()  # 0: at once
    with Client(f"127.0.0.1:{port}", connect_timeout_s=0) as c, pytest.raises(Unavailable):
        c.generate([1, 2, 3], max_tokens=4)
    assert time.monotonic() - t0 < 2
    t0 = time.monotonic()  # a call's own timeout bounds the wait too
    with Client(f"127.0.0.1:{port}") as c, pytest.raises(Unavailable):
        c.generate([1, 2, 3], max_tokens=4, timeout_s=1.0)
    assert time.monotonic() - t0 < 3


def test_a_request_whose_final_message_came_is_never_sent_again(router):
    servicer, address = router("final-then-break")
    with Client(address, reconnect_timeout_s=5) as client:
        result = client.generate([1, 2, 3], max_tokens=3, ignore_eos=True)
    assert result.token_ids == [10, 11, 12] and result.finish_reason == "length"
    assert len(servicer.calls) == 1 and result.timings["reconnects"] == 0


def test_a_stream_that_ends_without_its_final_message_is_an_error(router):
    _, address = router("no-final")
    with Client(address) as client, pytest.raises(StreamEnded, match="without its final"):
        client.generate([1, 2, 3], max_tokens=3, ignore_eos=True)


def _agenerate(address: str, reconnect_timeout_s: float = 5, **kwargs):
    import asyncio

    from pdserve.client import AsyncClient

    async def go():
        client = AsyncClient(address, reconnect_timeout_s=reconnect_timeout_s)
        try:
            return await client.generate([1, 2, 3], ignore_eos=True, **kwargs)
        finally:
            await client.close()

    return asyncio.run(go())


def test_the_async_client_continues_as_the_sync_one_does(router):
    servicer, address = router("dies")
    result = _agenerate(address, max_tokens=6)
    assert result.token_ids == [10, 11, 12, 13, 14, 15] and result.timings["reconnects"] == 1
    assert list(servicer.calls[1].continuation.ids) == [10, 11]


def test_the_async_client_does_not_resend_a_status_but_resends_a_call_never_taken(router):
    servicer, address = router("router-status")
    with pytest.raises(Unavailable):
        _agenerate(address, max_tokens=4)
    assert len(servicer.calls) == 1
    servicer, address = router("never-accepted")
    assert _agenerate(address, max_tokens=4).token_ids == [10, 11, 12, 13]
    assert len(servicer.calls) == 2


def test_the_async_client_never_resends_a_whole_request_nor_hides_a_missing_end(router):
    servicer, address = router("final-then-break")
    result = _agenerate(address, max_tokens=3)
    assert result.token_ids == [10, 11, 12] and result.timings["reconnects"] == 0
    assert len(servicer.calls) == 1
    _, address = router("no-final")
    with pytest.raises(StreamEnded, match="without its final"):
        _agenerate(address, max_tokens=3)


def test_the_async_stream_goes_on_through_a_restart_and_types_a_router_cancel(router):
    import asyncio

    from pdserve.client import AsyncClient, PdserveError

    async def tokens(address: str) -> list[int]:
        client = AsyncClient(address, reconnect_timeout_s=5)
        try:
            return [t async for t in client.stream([1, 2, 3], max_tokens=5, ignore_eos=True)]
        finally:
            await client.close()

    _, address = router("dies")
    assert asyncio.run(tokens(address)) == [10, 11, 12, 13, 14]
    _, address = router("cancelled")  # the router ends the call CANCELLED mid-stream
    with pytest.raises(PdserveError, match="CANCELLED"):
        asyncio.run(tokens(address))
