"""The gRPC client SDK: `from pdserve.client import Client, AsyncClient`.

    client = Client("127.0.0.1:50051")
    result = client.generate("Hello", max_tokens=32, temperature=0)
    result.token_ids, result.text, result.timings["ttft_s"]
    for token in client.stream([1, 2, 3], max_tokens=8): ...   # closing it aborts everywhere

    client = Client("node:50051", api_key="...", tls=TLS.from_files(None, None, "ca.pem"))

Keyword arguments mirror `SamplingParams` and are validated client-side (ValueError naming
the field); `request_id=` picks the request's id (else the router assigns a random one).
Server errors arrive as `PdserveError` subclasses carrying the gRPC status and whether a
retry can help (`retryable`).

A router that goes away after it accepted a request (killed, restarted by its supervisor)
does not lose it: the client sends the request again once the router answers, as a
continuation of the tokens it already has (GenerateRequest.continuation), and the stream
goes on with no token lost or repeated (greedy: the tokens an unbroken run gives). At most
`reconnects` times (3), each waiting at most `reconnect_timeout_s` (30 s) for the router;
`result.timings["reconnects"]` counts them. Within that wait a continuation that reaches
no router (the old one's channel can look ready a moment after it died; the new one may not
listen yet) is sent again. A request that reached no router at all (sent while one
restarts, or a moment before one died) waits up to `connect_timeout_s` (5 s, or the call's
own timeout if shorter; 0: fails at once) for one to answer and is sent then, not counted
among the `reconnects` (`reconnects=0` turns every resend off); so an address nobody
serves, or a TLS or name failure, fails after that wait.
A status the router answered itself is never retried (`retryable` says whether the caller
may).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from types import MappingProxyType

import grpc

from pdserve.rpc import ACCEPTED_KEY, GENERATE_VERSION, STATUS_KEY
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.sampling_params import SamplingParams
from pdserve.serving import auth
from pdserve.serving.auth import TLS, Security
from pdserve.serving.convert import sampling_to_proto, spans_from_proto
from pdserve.serving.server import MAX_MESSAGE_BYTES
from pdserve.trace import Span

__all__ = ["TLS", "AsyncClient", "Client", "GenerateResult", "PdserveError", "StreamEnded"]

TIMING_KEYS = (
    "queue_s",
    "prefill_s",
    "transfer_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "arrival_unix",
    "end_unix",
)


class PdserveError(RuntimeError):
    retryable = False  # whether the same request may succeed later

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class InvalidRequest(PdserveError, ValueError):
    """INVALID_ARGUMENT (or ALREADY_EXISTS: its request_id is taken): the request itself is
    wrong and will never succeed as it is."""


class Unauthorized(PdserveError):
    """UNAUTHENTICATED / PERMISSION_DENIED: a missing or wrong API key or cluster secret."""


class Overloaded(PdserveError):
    """RESOURCE_EXHAUSTED: no room now; retry later."""

    retryable = True


class Unavailable(PdserveError):
    """UNAVAILABLE: no worker can serve the request now."""

    retryable = True


class StreamEnded(PdserveError):
    """The router closed a request's stream without its final message (a bug: every
    request ends with a final message or a status); the tokens received are all there is."""

    retryable = True


_NO_FINAL = "the stream ended without its final message"
_TAKEN_PAUSE_S = 0.2  # before a continuation whose id the router still holds is sent again
_UNREACHED_PAUSE_S = 0.05  # before a continuation that reached no router is sent again,
_UNREACHED_PAUSE_MAX_S = 1.0  # doubling up to this
# a request no router took (none listening: one restarting, or none at that address): how
# long it waits for one to answer before its UNAVAILABLE is raised
FRESH_WAIT_S = 5.0
# gRPC's own redial backoff grows to 120 s by default: on a 2-vCPU VM a server back after a
# 20 s outage was first seen ready 6.1 s later (0.45 s with these; a throwaway probe), and
# after a longer one the redial can miss the whole reconnect window. Dial the router often.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # a final message carries the request's trace: its step spans are bounded
    # (decode/streams.py STEP_SPANS), but a request resumed or moved many times carries
    # every worker's share; the servers take as much
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


@dataclass(frozen=True)
class _Again:
    """How a broken request is sent again: after `pause_s`, once the channel is ready
    (waiting at most `ready_s` for it; 0: at once)."""

    pause_s: float
    ready_s: float


_KINDS = MappingProxyType(
    {
        grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
        grpc.StatusCode.ALREADY_EXISTS: InvalidRequest,
        grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
        grpc.StatusCode.UNAVAILABLE: Unavailable,
        grpc.StatusCode.UNAUTHENTICATED: Unauthorized,
        grpc.StatusCode.PERMISSION_DENIED: Unauthorized,
    }
)


def _error(e: grpc.RpcError) -> PdserveError:
    details = e.details() or ""
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        # gRPC's own message-size limit: this request can never pass, however long we wait
        return InvalidRequest(e.code(), f"prompt: the request is too large ({details})")
    return _KINDS.get(e.code(), PdserveError)(e.code(), details)


def _security(api_key: str | None, tls: TLS | None, security: Security | None) -> Security:
    if security is not None:
        return security
    return Security(api_key=api_key, tls=tls)


@dataclass
class GenerateResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    timings: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    trace: list[Span] = field(default_factory=list)  # every process's spans (pdserve.trace)

    def trace_record(self) -> dict:
        """This request's trace as one JSON-serialisable record (see pdserve.trace)."""
        return {
            "request_id": self.request_id,
            "arrival": self.timings.get("arrival_unix", 0.0),
            "end": self.timings.get("end_unix", 0.0),
            "spans": [s.to_dict() for s in self.trace],
        }


def build_request(
    prompt: str | list[int], sampling: dict, request_id: str = ""
) -> pb.GenerateRequest:
    """ValueError naming the field for what the router would refuse anyway: bad sampling
    values, and a message larger than the router accepts (gRPC would answer that one
    RESOURCE_EXHAUSTED, which reads as "retry later")."""
    params = SamplingParams(**sampling)
    msg = pb.GenerateRequest(
        protocol_version=GENERATE_VERSION,
        sampling=sampling_to_proto(params),
        request_id=request_id,
    )
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        msg.token_ids.ids.extend(prompt)
    if msg.ByteSize() > MAX_MESSAGE_BYTES:
        raise ValueError(
            f"prompt: the request is {msg.ByteSize()} bytes; the router accepts at most "
            f"{MAX_MESSAGE_BYTES} (and max_model_len tokens)"
        )
    return msg


def _build(prompt, sampling: dict) -> pb.GenerateRequest:
    request_id = sampling.pop("request_id", "")
    try:
        return build_request(prompt, sampling, request_id)
    except ValueError as e:
        raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def timings_of(t: pb.Timings) -> dict:
    """A final message's timings as a plain dict (seconds, wall-clock marks, worker ids)."""
    return {
        **{k: getattr(t, k) for k in TIMING_KEYS},
        "prefill_worker": t.prefill_worker,
        "decode_worker": t.decode_worker,
        "resumes": t.resumes,  # times the router moved it to another worker after a fault
        "migrations": t.migrations,  # times its KV moved to another decode worker live
    }


def _has(metadata, key: str) -> bool:
    return any(k == key for k, _ in metadata or ())


def _await_ready(channel: grpc.Channel, timeout_s: float, error: grpc.RpcError) -> None:
    """Until the router (restarted) answers again, else `error`."""
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout_s)
    except grpc.FutureTimeoutError:
        raise error from None
    finally:
        ready.cancel()  # else its subscription stays on the channel


@dataclass
class _Sent:
    """One request across the calls made for it (both clients): what the next call sends,
    the tokens it has, and whether its final message came."""

    request: pb.GenerateRequest
    on_call: Callable[[object], None] | None
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    reconnects: int = 0  # breaks after which it was sent again
    fresh: bool = False  # sent again after its first call reached no router
    window_ends: float = 0.0  # monotonic: until when the current reconnect may reach a router
    tries: int = 0  # continuations of the current reconnect that reached no router

    def called(self, call) -> None:
        if self.on_call is not None:
            self.on_call(call)

    def saw(self, msg: pb.GenerateResponse) -> pb.GenerateResponse:
        self.request.request_id = self.request.request_id or msg.request_id
        self.tokens.extend(msg.token_ids)
        self.finished = self.finished or msg.finished
        return msg

    def ended(self) -> None:
        """The stream closed: it must have brought its final message."""
        if not self.finished:
            raise StreamEnded(grpc.StatusCode.UNKNOWN, _NO_FINAL)

    def again(
        self,
        e: grpc.RpcError,
        metadata,
        limit: int,
        window_s: float,
        fresh_s: float = FRESH_WAIT_S,
        timeout_s: float | None = None,
    ) -> _Again | None:
        """After a call broke with `e` (`metadata`: the initial metadata it got): how the
        request is sent again as a continuation, or None when it is not.

        A call the router took (its accepted mark) that broke with no status of the
        router's own (it died or restarted) starts a reconnect, at most `limit` of them,
        each with `window_s` to reach a router. Within that window a continuation is sent
        again, after a pause, when it reached no router (after a router dies its channel
        can still look ready for a moment, and its successor may not listen yet: the call
        fails to connect) or when a router still alive holds the broken call's id a moment
        (ALREADY_EXISTS)."""
        code, taken = e.code(), _has(metadata, ACCEPTED_KEY)
        own = _has(e.trailing_metadata(), STATUS_KEY)
        now = time.monotonic()
        unreached = code == grpc.StatusCode.UNAVAILABLE and not taken and not own
        if unreached and limit and fresh_s and not (self.fresh or self.reconnects or self.tokens):
            # it reached no router, or one that died before taking it (a router takes every
            # call first thing): sent again once one answers, within `connect_timeout_s`
            # (and the call's own timeout), as a continuation of nothing (a router that died
            # may have begun it: the next gives it its own id on the workers). Not one of
            # the `reconnects`: those stay for breaks after a router took it.
            wait = min(window_s, fresh_s, timeout_s if timeout_s is not None else fresh_s)
            self.fresh, self.tries, self.window_ends = True, 0, now + wait
            return _Again(0.0, wait)
        if code == grpc.StatusCode.UNAVAILABLE and taken and not own:
            if self.reconnects >= limit:
                return None
            self.reconnects, self.tries = self.reconnects + 1, 0
            self.window_ends = now + window_s
            return _Again(0.0, window_s)
        if self.reconnects == 0 and not self.fresh:
            return None
        if code == grpc.StatusCode.ALREADY_EXISTS:
            pause = _TAKEN_PAUSE_S
        elif unreached:
            # a failed connection leaves the channel waiting out gRPC's own backoff before
            # it dials again; a fail-fast call made meanwhile fails at once, so back off too
            pause = min(_UNREACHED_PAUSE_S * 2 ** min(self.tries, 8), _UNREACHED_PAUSE_MAX_S)
            self.tries += 1
        else:
            return None
        left = self.window_ends - now  # the last try comes as the window ends
        return _Again(min(pause, left), 0.0) if left > 0 else None

    def continued(self) -> None:
        """The next call continues after the tokens this one brought."""
        self.request = _continuation(self.request, self.tokens)


def _continuation(request: pb.GenerateRequest, tokens: list[int]) -> pb.GenerateRequest:
    again = pb.GenerateRequest()
    again.CopyFrom(request)
    del again.continuation.ids[:]
    again.continuation.ids.extend(tokens)
    again.continuation.SetInParent()  # present even when empty: the router tells it apart
    return again


def _absorb(result: GenerateResult, msg: pb.GenerateResponse) -> None:
    result.request_id = msg.request_id
    result.token_ids.extend(msg.token_ids)
    if msg.finished:
        result.finish_reason = msg.finish_reason
        result.text = msg.text
        result.timings = timings_of(msg.timings)
        result.prompt_tokens = msg.prompt_tokens
        result.trace = spans_from_proto(msg.trace)


def _check_retries(reconnects: int, reconnect_timeout_s: float, connect_timeout_s: float):
    if reconnects < 0 or reconnect_timeout_s <= 0 or connect_timeout_s < 0:
        raise ValueError(
            "reconnects: must be >= 0, reconnect_timeout_s > 0, connect_timeout_s >= 0"
        )


class Client:
    """`api_key`: presented on every call (the router's --api-key); `tls`: the CA that signed
    the router's certificate (and this client's own certificate under mutual TLS);
    `security`: a cluster member's credentials instead (pdserve.launch uses it)."""

    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        tls: TLS | None = None,
        security: Security | None = None,
        reconnects: int = 3,
        reconnect_timeout_s: float = 30.0,
        connect_timeout_s: float = FRESH_WAIT_S,
    ) -> None:
        _check_retries(reconnects, reconnect_timeout_s, connect_timeout_s)
        self.channel = auth.channel(address, _security(api_key, tls, security), CHANNEL_OPTIONS)
        self.stub = rpc.RouterStub(self.channel)
        self.reconnects, self.reconnect_timeout_s = reconnects, reconnect_timeout_s
        self.connect_timeout_s = connect_timeout_s

    def messages(
        self,
        prompt: str | list[int],
        on_call: Callable[[object], None] | None = None,
        timeout_s: float | None = None,
        **sampling,
    ) -> Iterator[pb.GenerateResponse]:
        """The router's messages for one request, across router restarts (module doc);
        `on_call(call)` sees each gRPC call made for it (to cancel it from elsewhere),
        `timeout_s` bounds each. Raises grpc.RpcError as the last call ended, and
        StreamEnded when a stream closed without its final message."""
        yield from self._follow(_Sent(_build(prompt, sampling), on_call), timeout_s)

    def _follow(self, sent: _Sent, timeout_s: float | None) -> Iterator[pb.GenerateResponse]:
        while True:
            call = self.stub.Generate(sent.request, timeout=timeout_s)
            sent.called(call)
            try:
                for msg in call:
                    yield sent.saw(msg)
                sent.ended()
                return
            except grpc.RpcError as e:
                if sent.finished:
                    return  # the request is whole: whatever broke after, never send it again
                again = sent.again(
                    e, call.initial_metadata(), self.reconnects, self.reconnect_timeout_s,
                    self.connect_timeout_s, timeout_s,
                )  # fmt: skip
                if again is None:
                    raise
                time.sleep(again.pause_s)
                if again.ready_s:
                    _await_ready(self.channel, again.ready_s, e)
            finally:
                call.cancel()
            sent.continued()

    def health(self) -> pb.HealthResponse:
        try:
            return self.stub.Health(pb.Empty(), timeout=5)
        except grpc.RpcError as e:
            raise _error(e) from None

    def workers(self) -> list[pb.WorkerInfo]:
        try:
            return list(self.stub.ListWorkers(pb.Empty(), timeout=5).workers)
        except grpc.RpcError as e:
            raise _error(e) from None

    def generate(
        self, prompt: str | list[int], timeout_s: float | None = None, **sampling
    ) -> GenerateResult:
        result, sent = GenerateResult(request_id=""), _Sent(_build(prompt, sampling), None)
        try:
            for msg in self._follow(sent, timeout_s):
                _absorb(result, msg)
        except grpc.RpcError as e:
            raise _error(e) from None
        result.timings["reconnects"] = sent.reconnects
        return result

    def stream(self, prompt: str | list[int], **sampling) -> Iterator[int]:
        """Yields token ids as they arrive; closing the generator cancels the request."""
        messages = self.messages(prompt, **sampling)
        try:
            for msg in messages:
                yield from msg.token_ids
        except grpc.RpcError as e:  # CANCELLED too: the router (not we) ended the call
            raise _error(e) from None
        finally:
            messages.close()  # cancels the call in flight

    def abort(self, request_id: str) -> bool:
        """True when a request of this id, created by this client's key (or connection), was
        running and is now aborted; False for any other id, another owner's included."""
        try:
            return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=5).found
        except grpc.RpcError as e:
            raise _error(e) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The same API on grpc.aio, for asyncio programs and load generators; it continues
    requests through a router restart as Client does."""

    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        tls: TLS | None = None,
        security: Security | None = None,
        reconnects: int = 3,
        reconnect_timeout_s: float = 30.0,
        connect_timeout_s: float = FRESH_WAIT_S,
    ) -> None:
        _check_retries(reconnects, reconnect_timeout_s, connect_timeout_s)
        security = _security(api_key, tls, security)
        self.channel = auth.aio_channel(address, security, CHANNEL_OPTIONS)
        self.metadata = security.call_metadata()
        self.stub = rpc.RouterStub(self.channel)
        self.reconnects, self.reconnect_timeout_s = reconnects, reconnect_timeout_s
        self.connect_timeout_s = connect_timeout_s

    async def messages(
        self,
        prompt: str | list[int],
        on_call: Callable[[object], None] | None = None,
        timeout_s: float | None = None,
        **sampling,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Client.messages on asyncio: the router's messages for one request, across
        router restarts."""
        follow = self._follow(_Sent(_build(prompt, sampling), on_call), timeout_s)
        try:
            async for msg in follow:
                yield msg
        finally:
            await follow.aclose()  # cancels the call in flight

    async def _follow(
        self, sent: _Sent, timeout_s: float | None
    ) -> AsyncIterator[pb.GenerateResponse]:
        while True:
            call = self.stub.Generate(sent.request, metadata=self.metadata, timeout=timeout_s)
            sent.called(call)
            try:
                async for msg in call:
                    yield sent.saw(msg)
                sent.ended()
                return
            except grpc.RpcError as e:
                if sent.finished:
                    return  # the request is whole: whatever broke after, never send it again
                # an AioRpcError carries the initial metadata the call got
                again = sent.again(
                    e, e.initial_metadata(), self.reconnects, self.reconnect_timeout_s,
                    self.connect_timeout_s, timeout_s,
                )  # fmt: skip
                if again is None:
                    raise
                await asyncio.sleep(again.pause_s)
                try:  # until the router (restarted) answers again
                    if again.ready_s:
                        await asyncio.wait_for(self.channel.channel_ready(), again.ready_s)
                except asyncio.TimeoutError:
                    raise e from None
            finally:
                call.cancel()
            sent.continued()

    async def generate(
        self, prompt: str | list[int], timeout_s: float | None = None, **sampling
    ) -> GenerateResult:
        result, sent = GenerateResult(request_id=""), _Sent(_build(prompt, sampling), None)
        try:
            async for msg in self._follow(sent, timeout_s):
                _absorb(result, msg)
        except grpc.RpcError as e:
            raise _error(e) from None
        result.timings["reconnects"] = sent.reconnects
        return result

    async def stream(self, prompt: str | list[int], **sampling) -> AsyncIterator[int]:
        """Yields token ids as they arrive; closing the generator cancels the request."""
        messages = self.messages(prompt, **sampling)
        try:
            async for msg in messages:
                for token in msg.token_ids:
                    yield token
        except grpc.RpcError as e:  # CANCELLED too: the router (not we) ended the call
            raise _error(e) from None
        finally:
            await messages.aclose()  # cancels the call in flight

    async def close(self) -> None:
        await self.channel.close()
