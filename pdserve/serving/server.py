"""Starting a role's gRPC server, and the Health answer every role gives."""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures

import grpc

from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb

SERVER_THREADS = 64


def start_server(
    add_servicer: Callable[[grpc.Server], None], host: str, port: int, held_calls: int = 0
):
    """-> (server, bound port). Port 0 asks the OS for a free one. `held_calls`: how many
    long calls (streams) may hold a thread at once; SERVER_THREADS more stay for short ones
    (a router whose threads all held streams could not take the workers' heartbeats, and
    routed on what it knew when they stopped: the capacity sweep hung at 64 clients)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=held_calls + SERVER_THREADS))
    add_servicer(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, bound


def health(role: str, worker_id: str, reason: str = "") -> pb.HealthResponse:
    """ok unless `reason` says why not."""
    return pb.HealthResponse(
        ok=not reason,
        role=role,
        worker_id=worker_id,
        protocol_version=PROTOCOL_VERSION,
        reason=reason,
    )
