"""Starting a role's gRPC server and keeping it registered with the router."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent import futures

import grpc

from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc

HEARTBEAT_S = 1.0


def start_server(add_servicer: Callable[[grpc.Server], None], host: str, port: int):
    """-> (server, bound port). Port 0 asks the OS for a free one."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    add_servicer(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, bound


class Registration:
    """Registers a worker with the router and repeats it as a heartbeat with fresh stats."""

    def __init__(self, router: str, info: pb.WorkerInfo, stats: Callable[[], dict]) -> None:
        self.channel = grpc.insecure_channel(router)
        self.stub = rpc.RouterStub(self.channel)
        self.info = info
        self.stats = stats
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            info = pb.WorkerInfo()
            info.CopyFrom(self.info)
            for key, value in self.stats().items():
                if hasattr(info, key):
                    setattr(info, key, value)
            # the router may not be up yet or restarting: the next heartbeat retries
            with contextlib.suppress(grpc.RpcError):
                self.stub.Register(
                    pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=info), timeout=2
                )
            self._stop.wait(HEARTBEAT_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)
        self.channel.close()


def health(role: str, worker_id: str) -> pb.HealthResponse:
    return pb.HealthResponse(
        ok=True, role=role, worker_id=worker_id, protocol_version=PROTOCOL_VERSION
    )
