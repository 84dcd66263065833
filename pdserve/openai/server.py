"""The router's OpenAI-compatible HTTP server (aiohttp), next to its gRPC service.

    POST /v1/completions        POST /v1/chat/completions      (stream: server-sent events)
    GET  /v1/models             GET  /health                   GET  /metrics

Requests are validated here (400 naming the field), then go through the router's own gRPC
`Generate` as token ids, so that HTTP and SDK requests share one path (admission, worker
choice, timings, traces). gRPC failures map to HTTP: INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED
429 with Retry-After, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, anything else from a worker 502.
A client that disconnects mid-stream cancels the gRPC call, which aborts the request on every
worker. The server runs its own asyncio loop on a thread of the router process.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1
MAX_BODY_BYTES = 8 << 20

_STATUS = MappingProxyType(
    {
        grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
        grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
        grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
        grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    }
)


def _json_error(status: int, message: str, kind: str, param: str | None = None):
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return web.json_response(proto.error_body(message, kind, param), status=status, headers=headers)


def _param_of(message: str) -> str | None:
    """Our errors read 'field: what is wrong'."""
    head, sep, _ = message.partition(":")
    return head if sep and head.replace("_", "").isalnum() else None


def _grpc_error(e: grpc.RpcError):
    status, kind = _STATUS.get(e.code(), (502, "upstream_error"))
    message = e.details() or e.code().name
    return _json_error(status, message, kind, _param_of(message) if status == 400 else None)


@dataclass(frozen=True)
class RouterView:
    """What the front door needs of the router beside it (it calls the router over gRPC)."""

    vocab_size: int
    max_model_len: int
    tokenizer: Tokenizer | None
    metrics: CollectorRegistry  # served at /metrics
    workers: Callable[[], tuple[int, int]]  # live (prefill, decode) workers now


class OpenAIFrontDoor:
    def __init__(self, service: RouterView, grpc_address: str, model_name: str) -> None:
        self.service = service
        self.grpc_address = grpc_address
        self.model_name = model_name
        self.stub = None  # created on the server's loop

    # -- app -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self._connect)
        app.on_cleanup.append(self._disconnect)
        return app

    async def _connect(self, app) -> None:
        self.channel = grpc.aio.insecure_channel(self.grpc_address)
        self.stub = rpc.RouterStub(self.channel)

    async def _disconnect(self, app) -> None:
        await self.channel.close()

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except proto.BadRequest as e:
            return _json_error(400, e.message, "invalid_request_error", e.param)
        except web.HTTPException as e:  # 404, 405, 413 ... as OpenAI-style bodies
            if e.status < 400:
                raise
            return _json_error(e.status, e.reason, "invalid_request_error")

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
        try:
            return await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise proto.BadRequest(None, f"the request body is not valid JSON ({e})") from None

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
        if isinstance(req.prompt, list):
            return req.prompt
        if self.service.tokenizer is None:
            raise proto.BadRequest("prompt", "prompt: this model has no tokenizer; send token ids")
        return self.service.tokenizer.encode(req.prompt)

    async def _generate(self, request, req: proto.OpenAIRequest) -> web.StreamResponse:
        ids = self._prompt_ids(req)
        limit = self.service.max_model_len
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
        call = self.stub.Generate(msg)
        try:
            if req.stream:
                return await self._stream(request, req, rid, call, len(ids))
            return await self._whole(req, rid, call, len(ids))
        except grpc.RpcError as e:
            return _grpc_error(e)
        finally:
            call.cancel()  # a no-op once finished; aborts everywhere otherwise

    async def _whole(self, req, rid, call, prompt_tokens: int) -> web.Response:
        text = TextStream(self.service.tokenizer, req.stop)
        parts, produced, finish, extra = [], 0, "length", {}
        async for msg in call:
            produced += len(msg.token_ids)
            parts.append(text.add(list(msg.token_ids)))
            if text.stopped:
                finish = "stop"
                break
            if msg.finished:
                parts.append(text.finish())
                finish = _finish(msg.finish_reason)
                extra = _extra(msg)
        use = proto.usage(prompt_tokens, produced)
        body = proto.completion_body(
            rid, self.model_name, req.chat, "".join(parts), finish, use, extra
        )
        return web.json_response(body)

    async def _stream(self, request, req, rid, call, prompt_tokens: int) -> web.StreamResponse:
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

        text = TextStream(self.service.tokenizer, req.stop)
        model, chat = self.model_name, req.chat
        if chat:
            await send(proto.chunk_body(rid, model, chat, "", None))
        produced, finish, msg = 0, "length", first
        try:
            while msg is not grpc.aio.EOF:
                produced += len(msg.token_ids)
                delta = text.add(list(msg.token_ids))
                if msg.finished and not text.stopped:
                    delta += text.finish()
                    finish = _finish(msg.finish_reason)
                if delta:
                    await send(proto.chunk_body(rid, model, chat, delta, None))
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
        await send(proto.chunk_body(rid, model, chat, None, finish))
        if req.include_usage:
            await send(proto.usage_chunk(rid, model, chat, proto.usage(prompt_tokens, produced)))
        await send("[DONE]")
        await response.write_eof()
        return response


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _extra(msg: pb.GenerateResponse) -> dict:
    return {"request_id": msg.request_id, "timings": timings_of(msg.timings)}


class HTTPServerThread:
    """Runs the front door on its own asyncio loop; `port` is the bound port."""

    def __init__(self, front: OpenAIFrontDoor, host: str, port: int) -> None:
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(front.app(), access_log=None)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(host, port), name="openai-http", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout=30) or self._error is not None:
            raise RuntimeError(f"HTTP server failed to start on {host}:{port}: {self._error}")

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, host, port)
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


def start_http(service: RouterView, grpc_port: int, host: str, port: int, model_name: str):
    connect = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    front = OpenAIFrontDoor(service, f"{connect}:{grpc_port}", model_name)
    started = time.monotonic()
    server = HTTPServerThread(front, host, port)
    log.info("OpenAI HTTP on %s:%d (%.2fs)", host, server.port, time.monotonic() - started)
    return server
