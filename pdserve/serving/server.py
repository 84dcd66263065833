"""Starting a role's gRPC server, and the Health answer every role gives."""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures

import grpc

from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.serving.auth import AuthInterceptor, Security

SERVER_THREADS = 64
# gRPC's own default (4 MiB) answers a larger message RESOURCE_EXHAUSTED, which a client
# reads as "retry later". Every role takes messages up to this size, so that a prompt far
# beyond max_model_len reaches validation and is answered INVALID_ARGUMENT naming `prompt`
# (10M token ids fit); the SDK refuses larger ones itself (pdserve/client.py).
MAX_MESSAGE_BYTES = 64 << 20
# A caller whose host vanished without a reset (powered off, cut off, frozen) held its calls
# here until TCP gave up, which can take many minutes: a router's feed and every stream it
# started on a decode worker (a thread each), an SDK client's Generate on the router. The
# server pings each connection this often and ends it when a ping is not answered within
# KEEPALIVE_TIMEOUT_S (gRPC's ping timeout too: its own default is 60 s, and without it
# a frozen client was never let go; a throwaway probe, docs/faults.md). Answering a ping is
# gRPC's own work in the client: a live but busy client keeps its calls.
KEEPALIVE_S = 20.0
KEEPALIVE_TIMEOUT_S = 10.0


def keepalive_options(every_s: float, timeout_s: float) -> list[tuple[str, int]]:
    timeout_ms = int(timeout_s * 1000)
    return [
        ("grpc.keepalive_time_ms", int(every_s * 1000)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.http2.max_pings_without_data", 0),  # an idle feed sends no data for long
    ]


def start_server(
    add_servicer: Callable[[grpc.Server], None],
    host: str,
    port: int,
    held_calls: int = 0,
    security: Security | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    keepalive: tuple[float, float] = (KEEPALIVE_S, KEEPALIVE_TIMEOUT_S),
):
    """-> (server, bound port). Port 0 asks the OS for a free one. `held_calls`: how many
    long calls (streams) may hold a thread at once; SERVER_THREADS more stay for short ones
    (a router whose threads all held streams could not take the workers' heartbeats, and
    routed on what it knew when they stopped: the capacity sweep hung at 64 clients).
    `security`: the doors every RPC passes (pdserve/serving/auth.py) and TLS when set.
    `keepalive`: (ping every, answer within) seconds: a caller gone silent loses its calls."""
    security = security or Security()
    options = [("grpc.max_receive_message_length", max_message_bytes)]
    options += keepalive_options(*keepalive)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=held_calls + SERVER_THREADS),
        interceptors=[AuthInterceptor(security), ParseGuard()],
        options=options,
    )
    add_servicer(server)
    address = f"{host}:{port}"
    if security.tls is not None:
        bound = server.add_secure_port(address, security.tls.server_credentials())
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, bound


class _Unparsed:
    def __init__(self, error: Exception) -> None:
        self.error = error


class ParseGuard(grpc.ServerInterceptor):
    """A request body that is not the method's message (cut, bit-flipped, invalid UTF-8 in
    a string) is answered INVALID_ARGUMENT, not gRPC's own INTERNAL ("Exception
    deserializing request!"), which reads as the server's fault."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        parse = handler.request_deserializer

        def guarded_parse(body: bytes):
            try:
                return parse(body)
            except Exception as e:  # noqa: BLE001 - DecodeError and its kin: the body is bad
                return _Unparsed(e)

        def refuse(request: _Unparsed, context):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request: not a valid message for {details.method} ({request.error})",
            )

        streaming = handler.response_streaming
        behavior = handler.unary_stream if streaming else handler.unary_unary

        def guarded(request, context):
            if isinstance(request, _Unparsed):
                refuse(request, context)
            return behavior(request, context)

        make = (
            grpc.unary_stream_rpc_method_handler
            if streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(guarded, guarded_parse, handler.response_serializer)


def health(role: str, worker_id: str, reason: str = "") -> pb.HealthResponse:
    """ok unless `reason` says why not."""
    return pb.HealthResponse(
        ok=not reason,
        role=role,
        worker_id=worker_id,
        protocol_version=PROTOCOL_VERSION,
        reason=reason,
    )
