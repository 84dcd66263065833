"""The router's Generate called in-process by its front door (pdserve/openai/local_call.py):
read as a grpc.aio call is read, with gRPC's semantics for an abort, a raise, a cancel and a
refused door. Fake Generate generators with exact expectations; the launched front door on
both paths is in tests/test_openai.py."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from pdserve.openai.local_call import LocalRouter
from pdserve.rpc import pdserve_pb2 as pb

WAIT_S = 10.0


def _router(generate, refusal=lambda metadata: None) -> LocalRouter:
    return LocalRouter(generate, refusal, max_calls=4)


def _read_all(router: LocalRouter, metadata=()) -> list:
    async def go():
        call = router.generate(pb.GenerateRequest(), metadata)
        return [msg.request_id async for msg in call]

    return asyncio.run(asyncio.wait_for(go(), WAIT_S))


def test_messages_arrive_in_order_then_the_end_and_callbacks_run_once_at_the_end():
    ran = []

    def generate(request, context):
        assert context.is_active() and context.add_callback(lambda: ran.append("cb"))
        assert dict(context.invocation_metadata()) == {"authorization": "Bearer k"}
        for i in range(3):
            yield pb.GenerateResponse(request_id=f"m{i}")

    router = _router(generate)
    assert _read_all(router, (("authorization", "Bearer k"),)) == ["m0", "m1", "m2"]
    assert ran == ["cb"]
    router.close()


def test_an_abort_is_raised_with_its_status_after_the_messages_before_it():
    def generate(request, context):
        yield pb.GenerateResponse(request_id="first")
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "router queue is full")

    router = _router(generate)

    async def go():
        call = router.generate(pb.GenerateRequest(), ())
        first = await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert await call.read() is grpc.aio.EOF  # a failed call reads as ended after
        return first.request_id, e.value

    rid, error = asyncio.run(asyncio.wait_for(go(), WAIT_S))
    assert rid == "first"
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == "router queue is full"
    router.close()


def test_a_generate_that_raises_is_unknown_as_grpc_answers_it():
    def generate(request, context):
        raise RuntimeError("boom")
        yield  # pragma: no cover - a generator

    router = _router(generate)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _read_all(router)
    assert e.value.code() is grpc.StatusCode.UNKNOWN and "boom" in e.value.details()
    router.close()


def test_a_cancel_runs_the_callbacks_and_closes_the_generator():
    """The request's callbacks (which abort it on the workers) run when the front door
    cancels; the generator, blocked on its worker, sees the call inactive and is closed at
    its next message, as gRPC closes a cancelled call's."""
    woken, closed = threading.Event(), threading.Event()

    def generate(request, context):
        context.add_callback(woken.set)  # a relay's stream.cancel
        try:
            yield pb.GenerateResponse(request_id="one")
            assert woken.wait(WAIT_S)  # blocked until the cancel
            assert not context.is_active()
            yield pb.GenerateResponse(request_id="after the cancel")
            raise AssertionError("not closed")
        except GeneratorExit:
            closed.set()
            raise

    router = _router(generate)

    async def go():
        call = router.generate(pb.GenerateRequest(), ())
        assert (await call.read()).request_id == "one"
        assert call.cancel()

    asyncio.run(asyncio.wait_for(go(), WAIT_S))
    assert woken.is_set() and closed.wait(WAIT_S)
    router.close()


def test_a_refused_door_is_answered_before_the_router_sees_the_call():
    def generate(request, context):
        raise AssertionError("the router saw a refused call")
        yield  # pragma: no cover

    def refusal(metadata):
        if metadata.get("authorization") != "Bearer good":
            return grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required"
        return None

    router = _router(generate, refusal)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _read_all(router, (("authorization", "Bearer bad"),))
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
    router.close()
