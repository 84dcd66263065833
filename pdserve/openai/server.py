"""The router's OpenAI-compatible HTTP server (aiohttp), next to its gRPC service.

    POST /v1/completions        POST /v1/chat/completions      (stream: server-sent events)
    GET  /v1/models             GET  /health                   GET  /metrics

Requests are validated here (400 naming the field), then go through the router's own
`Generate` as token ids, so that HTTP and SDK requests share one path (admission, worker
choice, timings, traces): called in this process (pdserve/openai/local_call.py) when the
router gives its service, else over a gRPC call to the router's port. gRPC failures map to
HTTP: INVALID_ARGUMENT 400, UNAUTHENTICATED 401, PERMISSION_DENIED 403, ALREADY_EXISTS 409,
RESOURCE_EXHAUSTED 429 with Retry-After, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, anything
else from a worker 502. A client that disconnects mid-stream cancels the call, which aborts
the request on every worker. The server runs its own asyncio loop on a thread of the router
process.

Bodies are read as JSON whatever their Content-Type says (`curl -d` sends a form type), and
strictly (strict_json.loads): anything malformed is a 400 naming where it is, never a 500. With
`api_keys` set, every path but `public_paths` needs `Authorization: Bearer <key>` before its
body is read (401 otherwise); the key that was presented goes on to the router as gRPC
metadata, and is never logged or echoed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pdserve.client import build_request, timings_of
from pdserve.openai import protocol as proto
from pdserve.openai.detok import TextStream
from pdserve.openai.local_call import LocalRouter
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.tokenizer import Tokenizer
from pdserve.validation import RequestValidator

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1
MAX_BODY_BYTES = 8 << 20

_STATUS = MappingProxyType(
    {
        grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
        grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
        grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
        grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
        grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
        grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
        grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    }
)


def _json_error(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None
):
    headers = {}
    if status == 429:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body = proto.error_body(message, kind, param, code)
    return web.json_response(body, status=status, headers=headers)


def _param_of(message: str) -> str | None:
    """Our errors read 'field: what is wrong'."""
    head, sep, _ = message.partition(":")
    return head if sep and head.replace("_", "").isalnum() else None


def _grpc_error(e: grpc.RpcError):
    status, kind = _STATUS.get(e.code(), (502, "upstream_error"))
    message = e.details() or e.code().name
    return _json_error(status, message, kind, _param_of(message) if status == 400 else None)


def _bearer(header: str | None) -> str | None:
    scheme, _, key = (header or "").strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def _known(key: str, keys: tuple[str, ...]) -> bool:
    """Compared with every key, not stopping at a match, so the time says nothing."""
    presented = key.encode("utf-8", "surrogatepass")
    found = False
    for k in keys:
        found |= hmac.compare_digest(presented, k.encode())
    return found


def _sendable(key: str) -> bool:
    """A gRPC metadata value (and an HTTP header value) is printable ASCII."""
    return key.isascii() and key.isprintable()


@dataclass(frozen=True)
class RouterView:
    """What the front door needs of the router beside it (it calls the router's Generate in
    its process through `local`, else over gRPC)."""

    vocab_size: int
    max_model_len: int
    tokenizer: Tokenizer | None
    metrics: CollectorRegistry  # served at /metrics
    workers: Callable[[], tuple[int, int]]  # live (prefill, decode) workers now
    api_keys: tuple[str, ...] = ()  # empty: no key needed
    public_paths: tuple[str, ...] = ("/health", "/metrics")  # reachable without a key
    grpc_metadata: tuple[tuple[str, str], ...] = ()  # on every call to the router
    # address -> channel to the router (TLS, credentials); None: an insecure channel
    channel_factory: Callable[[str], grpc.aio.Channel] | None = None
    # the router's Generate in this process: no gRPC call (set: the channel is not used)
    local: LocalRouter | None = None

    def __post_init__(self) -> None:
        for name in ("api_keys", "public_paths"):
            if isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: expected a tuple of strings, got one string")
        if not all(isinstance(k, str) and k and _sendable(k) for k in self.api_keys):
            raise ValueError("api_keys: each key must be non-empty printable ASCII")


class OpenAIFrontDoor:
    def __init__(self, service: RouterView, grpc_address: str, model_name: str) -> None:
        self.service = service
        self.grpc_address = grpc_address
        self.model_name = model_name
        self.stub = None  # created on the server's loop
        self.validator = RequestValidator(
            vocab_size=service.vocab_size,
            max_model_len=service.max_model_len,
            tokenizer=service.tokenizer,
        )

    # -- app -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=MAX_BODY_BYTES, middlewares=[self._auth, self._errors]
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self._connect)
        app.on_cleanup.append(self._disconnect)
        return app

    async def _connect(self, app) -> None:
        if self.service.local is not None:
            return
        factory = self.service.channel_factory or grpc.aio.insecure_channel
        self.channel = factory(self.grpc_address)
        self.stub = rpc.RouterStub(self.channel)

    async def _disconnect(self, app) -> None:
        if self.stub is not None:
            await self.channel.close()

    @web.middleware
    async def _auth(self, request, handler):
        """Runs before any handler reads the body."""
        key = _bearer(request.headers.get("Authorization"))
        keys = self.service.api_keys
        if keys and request.path not in self.service.public_paths:
            if key is None:
                message = "authorization: missing API key; send 'Authorization: Bearer <key>'"
                return _json_error(401, message, "authentication_error", code="missing_api_key")
            if not _known(key, keys):
                message = "authorization: the API key is not valid"
                return _json_error(401, message, "authentication_error", code="invalid_api_key")
        return await handler(request)

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except proto.BadRequest as e:
            return _json_error(400, e.message, "invalid_request_error", e.param)
        except web.HTTPException as e:  # 404, 405, 413 ... as OpenAI-style bodies
            if e.status < 400:
                raise
            message = f"body: over {MAX_BODY_BYTES} bytes" if e.status == 413 else e.reason
            return _json_error(e.status, message, "invalid_request_error")
        except (asyncio.CancelledError, ConnectionResetError):  # the client went: no answer
            raise
        except Exception as e:  # noqa: BLE001 -- a bug here: OpenAI's error shape, logged
            log.exception("the front door failed on %s %s", request.method, request.path)
            return _json_error(500, f"internal error: {type(e).__name__}", "server_error")

    # -- simple endpoints ------------------------------------------------------------------
    async def models(self, request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "pdserve",
                        "max_model_len": self.service.max_model_len,
                    }
                ],
            }
        )

    async def health(self, request) -> web.Response:
        prefill, decode = self.service.workers()
        body = {"status": "ok" if prefill and decode else "unavailable"}
        body.update(prefill_workers=prefill, decode_workers=decode)
        return web.json_response(body, status=200 if prefill and decode else 503)

    async def metrics(self, request) -> web.Response:
        body = generate_latest(self.service.metrics)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- generation ------------------------------------------------------------------------
    async def _body(self, request) -> object:
        """The body as JSON, whatever the Content-Type (see the module docstring)."""
        return proto.loads(await request.read())  # over MAX_BODY_BYTES: 413

    async def completions(self, request) -> web.StreamResponse:
        body = await self._body(request)
        vocab = self.service.vocab_size
        return await self._generate(request, proto.parse_completion(body, vocab))

    async def chat_completions(self, request) -> web.StreamResponse:
        tokenizer = self.service.tokenizer
        if tokenizer is None:
            raise proto.BadRequest(None, "this model has no tokenizer, so no chat template")
        body = await self._body(request)
        vocab = self.service.vocab_size
        parsed = proto.parse_chat(body, vocab, tokenizer.apply_chat_template)
        return await self._generate(request, parsed)

    def _prompt_ids(self, req: proto.OpenAIRequest) -> list[int]:
        field = "messages" if req.chat else "prompt"  # a chat prompt is its rendered messages
        try:
            return self.validator.prompt(req.prompt, field)
        except ValueError as e:
            raise proto.BadRequest(field, str(e)) from None

    async def _generate(self, request, req: proto.OpenAIRequest) -> web.StreamResponse:
        if req.stop and self.service.tokenizer is None:
            raise proto.BadRequest("stop", "stop: this model has no tokenizer: no text to stop on")
        ids = self._prompt_ids(req)
        limit = self.service.max_model_len
        if req.max_tokens is None and len(ids) >= limit:  # chat without a limit: the rest
            field = "messages" if req.chat else "prompt"
            raise proto.BadRequest(
                field,
                f"{field}: the prompt's {len(ids)} tokens leave no room in the model's "
                f"context of {limit}",
            )
        max_tokens = req.max_tokens if req.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise proto.BadRequest(
                "max_tokens",
                f"max_tokens: prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds "
                f"the model's context of {limit}",
            )
        try:
            msg = build_request(ids, {"max_tokens": max_tokens, **req.sampling})
        except ValueError as e:
            raise proto.BadRequest(_param_of(str(e)), str(e)) from None
        rid = proto.new_id(req.chat)
        msg.request_id = rid
        metadata = [*self.service.grpc_metadata]
        key = _bearer(request.headers.get("Authorization"))
        if key is not None and _sendable(key):  # checked by _auth when api_keys are set
            metadata.append(("authorization", f"Bearer {key}"))
        if self.service.local is not None:
            call = self.service.local.generate(msg, tuple(metadata))
        else:
            call = self.stub.Generate(msg, metadata=tuple(metadata) or None)
        try:
            if req.stream:
                return await self._stream(request, req, rid, call, ids)
            return await self._whole(req, rid, call, ids)
        except grpc.RpcError as e:
            return _grpc_error(e)
        finally:
            call.cancel()  # a no-op once finished; aborts everywhere otherwise

    async def _whole(self, req, rid, call, prompt: list[int]) -> web.Response:
        prompt_tokens = len(prompt)
        text = TextStream(self.service.tokenizer, req.stop, prompt)
        parts, produced, finish, extra = [], 0, "length", {}
        async for msg in call:
            delta, used = text.take(list(msg.token_ids))
            produced += used
            parts.append(delta)
            if text.stopped:
                finish = "stop"
                break
            if msg.finished:
                if msg.finish_reason == "abort":  # ended for it, not by its model: no answer
                    return _json_error(500, ABORTED, "server_error", None)
                parts.append(text.finish())
                finish = _finish(msg.finish_reason)
                extra = _extra(msg)
        use = proto.usage(prompt_tokens, produced)
        body = proto.completion_body(
            rid, self.model_name, req.chat, "".join(parts), finish, use, extra
        )
        return web.json_response(body)

    async def _stream(self, request, req, rid, call, prompt: list[int]) -> web.StreamResponse:
        prompt_tokens = len(prompt)
        # The first message decides between an HTTP error and a stream (queue full, bad
        # input, no workers all arrive before it).
        first = await call.read()
        if first is grpc.aio.EOF:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "no response")
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)

        async def send(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        text = TextStream(self.service.tokenizer, req.stop, prompt)
        model, chat = self.model_name, req.chat
        created = int(time.time())  # one for every chunk of the stream, as OpenAI's
        if chat:
            await send(proto.chunk_body(rid, model, chat, "", None, created))
        produced, finish, msg = 0, "length", first
        try:
            while msg is not grpc.aio.EOF:
                delta, used = text.take(list(msg.token_ids))
                produced += used
                if msg.finished and msg.finish_reason == "abort":
                    await send(proto.error_body(ABORTED, "server_error"))
                    await send("[DONE]")
                    return response
                if msg.finished and not text.stopped:
                    delta += text.finish()
                    finish = _finish(msg.finish_reason)
                if delta:
                    await send(proto.chunk_body(rid, model, chat, delta, None, created))
                if text.stopped:
                    finish = "stop"
                    break
                if msg.finished:
                    break
                msg = await call.read()
        except grpc.RpcError as e:
            status, kind = _STATUS.get(e.code(), (502, "upstream_error"))
            await send(proto.error_body(e.details() or e.code().name, kind))
            await send("[DONE]")
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001 -- the stream is open: its error is an event
            log.exception("the front door's stream failed")
            await send(proto.error_body(f"internal error: {type(e).__name__}", "server_error"))
            await send("[DONE]")
            return response
        await send(proto.chunk_body(rid, model, chat, None, finish, created))
        if req.include_usage:
            use = proto.usage(prompt_tokens, produced)
            await send(proto.usage_chunk(rid, model, chat, use, created))
        await send("[DONE]")
        await response.write_eof()
        return response


# a request the serving side ended (an Abort, a worker giving it up) is not a finished
# answer: an error, never finish_reason "stop" on text cut short
ABORTED = "the request was aborted before it finished"


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _extra(msg: pb.GenerateResponse) -> dict:
    return {"request_id": msg.request_id, "timings": timings_of(msg.timings)}


class HTTPServerThread:
    """Runs the front door on its own asyncio loop; `port` is the bound port."""

    def __init__(
        self,
        front: OpenAIFrontDoor,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        # a client that goes cancels its handler (aiohttp's default leaves it running): a
        # whole completion's call is then aborted at once, not decoded to its end for nobody
        self._runner = web.AppRunner(front.app(), access_log=None, handler_cancellation=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(host, port, ssl_context), name="openai-http", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout=30) or self._error is not None:
            raise RuntimeError(f"HTTP server failed to start on {host}:{port}: {self._error}")

    def _run(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
        except BaseException as e:  # noqa: BLE001 - reported to the starting thread
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)


def start_http(
    service: RouterView,
    grpc_port: int,
    host: str,
    port: int,
    model_name: str,
    ssl_context: ssl.SSLContext | None = None,  # given: HTTPS
):
    connect = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    front = OpenAIFrontDoor(service, f"{connect}:{grpc_port}", model_name)
    started = time.monotonic()
    server = HTTPServerThread(front, host, port, ssl_context)
    scheme = "HTTPS" if ssl_context is not None else "HTTP"
    elapsed = time.monotonic() - started
    log.info("OpenAI %s on %s:%d (%.2fs)", scheme, host, server.port, elapsed)
    return server
