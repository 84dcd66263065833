"""The router's Generate for its own OpenAI front door, in the same process.

The front door used to call the router over a loopback gRPC call: every token was a
message serialised, framed, sent, received and parsed again inside one process, with a
thread hand-off on each side (a tenth of a core at 270 tokens/s on a 2-CPU machine, where
the workers compute). Here the router's own Generate generator runs on a thread of a pool,
with a context that offers what the router uses of a gRPC one (abort, is_active, callbacks
run when the call ends or is cancelled, its metadata), and hands each message to the front
door's asyncio loop. The front door reads a LocalCall as it reads a grpc.aio call: `read()`
(grpc.aio.EOF at the end), `async for`, `cancel()`, failures raised as
grpc.aio.AioRpcError with the status the router ended the call with.

The doors still hold: `refusal` (the router's own check of the `Router.Generate` door,
pdserve/serving/auth.py) refuses a call as its gRPC server would, before the router sees it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from pdserve.rpc import pdserve_pb2 as pb

log = logging.getLogger(__name__)

# the pool's threads beyond the router's admitted calls: a call past its queue's bound is
# answered RESOURCE_EXHAUSTED by the router, so it needs a thread to be answered at all
SPARE_THREADS = 16


class _Aborted(Exception):
    """Raised by LocalContext.abort, as gRPC's own abort raises (the handler unwinds)."""


class LocalContext:
    """What the router's Generate uses of a grpc.ServicerContext."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._active = True
        self._code: grpc.StatusCode | None = None
        self._details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "local:openai"

    def is_active(self) -> bool:
        return self._active

    def send_initial_metadata(self, metadata) -> None:
        pass

    def set_trailing_metadata(self, metadata) -> None:
        pass

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if not self._active:
                return False
            self._callbacks.append(callback)
            return True

    def abort(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details
        raise _Aborted(details)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def end(self) -> None:
        """The call ended (its generator returned or raised) or was cancelled: it is no
        longer active, and its callbacks run once."""
        with self._lock:
            if not self._active:
                return
            self._active = False
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one callback's failure must not skip the rest
                log.exception("a call's callback failed")


class LocalCall:
    """One Generate running on a pool thread, read on the front door's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, context: LocalContext) -> None:
        self._loop = loop
        self._context = context
        self._messages: asyncio.Queue = asyncio.Queue()
        self._done = False

    def drive(self, responses: Callable[[LocalContext], Iterator[pb.GenerateResponse]]) -> None:
        """(On a pool thread.) Run the call to its end, each message to the loop."""
        context = self._context
        if not context.is_active():  # cancelled while it waited for a thread
            return
        ending: object = grpc.aio.EOF
        try:
            generator = responses(context)
            for msg in generator:
                if not context.is_active():  # cancelled: as gRPC does, close the generator
                    generator.close()
                    break
                self._post(msg)
        except _Aborted:
            ending = _error(context.code() or grpc.StatusCode.UNKNOWN, context.details())
        except Exception as e:  # noqa: BLE001 - what gRPC answers a handler that raised
            log.exception("the router's Generate raised")
            ending = _error(grpc.StatusCode.UNKNOWN, f"Exception iterating responses: {e}")
        finally:
            context.end()
        self._post(ending)

    def _post(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._messages.put_nowait, item)
        except RuntimeError:  # the loop is closed: the front door is gone
            self._context.end()

    async def read(self):
        if self._done:
            return grpc.aio.EOF
        item = await self._messages.get()
        if isinstance(item, grpc.RpcError):
            self._done = True
            raise item
        if item is grpc.aio.EOF:
            self._done = True
        return item

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while (msg := await self.read()) is not grpc.aio.EOF:
            yield msg

    def cancel(self) -> bool:
        """Abort the request everywhere (a no-op once it ended)."""
        self._context.end()
        return True


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class LocalRouter:
    """The router service's Generate, for its front door (see the module docstring)."""

    def __init__(
        self,
        generate: Callable[[pb.GenerateRequest, LocalContext], Iterator[pb.GenerateResponse]],
        refusal: Callable[[dict[str, str]], tuple[grpc.StatusCode, str] | None],
        max_calls: int,
        on_call: Callable[[], None] = lambda: None,  # each call past its door
    ) -> None:
        self._generate = generate
        self._refusal = refusal
        self._on_call = on_call
        self._pool = ThreadPoolExecutor(
            max_workers=max_calls + SPARE_THREADS, thread_name_prefix="router-local"
        )

    def generate(self, request: pb.GenerateRequest, metadata) -> LocalCall:
        """(On the front door's loop.) The call, started."""
        metadata = tuple(metadata or ())
        context = LocalContext(metadata)
        call = LocalCall(asyncio.get_running_loop(), context)
        refused = self._refusal(dict(metadata))
        if refused is not None:
            code, details = refused
            context.end()
            call._post(_error(code, details))
            return call
        self._on_call()
        self._pool.submit(call.drive, lambda ctx: self._generate(request, ctx))
        return call

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
