"""Every request's outcome counted by the router (pdserve_router_requests_total), and a
forgotten worker's series gone from /metrics. Real gRPC servers in this process, a slow fake
decode worker (tests/test_auth.py) so that a stream can be cut mid-way."""

from __future__ import annotations

import time

import pytest
from test_auth import FakePrefill, SlowDecode

from pdserve.client import Client
from pdserve.router.config import RouterConfig
from pdserve.router.service import RouterService
from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.server import start_server


def outcomes(service: RouterService) -> dict[str, float]:
    return {
        s.labels["outcome"]: s.value
        for metric in service.metrics.registry.collect()
        if metric.name == "pdserve_router_requests"
        for s in metric.samples
        if s.name.endswith("_total")
    }


@pytest.fixture
def router():
    servers = []

    def serve(add) -> str:
        server, port = start_server(add, "127.0.0.1", 0)
        servers.append(server)
        return f"127.0.0.1:{port}"

    config = RouterConfig(max_model_len=64, queue_timeout_s=0.5)
    service = RouterService(config, 100, None)
    address = serve(lambda s: rpc.add_RouterServicer_to_server(service, s))

    def register(wid: str, role: str, free: int = 8) -> None:
        servicer = SlowDecode() if role == "decode" else FakePrefill()
        add = (
            rpc.add_DecodeServicer_to_server
            if role == "decode"
            else rpc.add_PrefillServicer_to_server
        )
        at = serve(lambda s: add(servicer, s))
        info = pb.WorkerInfo(
            worker_id=wid,
            role=role,
            address=at,
            total_blocks=8,
            free_blocks=free,
            headroom_blocks=8,
        )
        rpc.RouterStub(channel).Register(
            pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=info), timeout=5
        )

    import grpc

    channel = grpc.insecure_channel(address)
    yield service, address, register
    channel.close()
    for server in servers:
        server.stop(grace=0)


def test_cancelled_failed_and_finished_requests_are_each_counted(router):
    service, address, register = router
    with Client(address) as client:
        register("d", "decode")
        register("p", "prefill")
        assert client.generate([1], max_tokens=2).finish_reason == "length"
        for _ in range(3):  # the client walks away mid-stream, three times
            stream = client.stream([1], max_tokens=2)
            next(stream)
            stream.close()
        deadline = time.monotonic() + 5
        while outcomes(service).get("cancelled", 0) < 3:
            assert time.monotonic() < deadline, outcomes(service)
            time.sleep(0.02)
    got = outcomes(service)
    assert got["length"] == 1 and got["cancelled"] == 3, got


def test_a_request_the_router_gives_up_on_is_counted_by_its_status(router):
    from pdserve.client import Unavailable

    service, address, _ = router
    with Client(address) as client, pytest.raises(Unavailable):
        client.generate([1], max_tokens=2)  # no worker registers within the queue timeout
    assert outcomes(service) == {"failed_unavailable": 1.0}


def test_a_forgotten_workers_kv_series_leaves_metrics():
    from prometheus_client import generate_latest

    service = RouterService(RouterConfig(max_model_len=64, forget_after_s=0.2), 100, None)
    info = pb.WorkerInfo(
        worker_id="d-gone", role="decode", address="127.0.0.1:9", total_blocks=8, free_blocks=2
    )
    service.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=info), None)
    text = generate_latest(service.metrics.registry).decode()
    assert 'pdserve_router_kv_usage_ratio{worker="d-gone"} 0.75' in text
    deadline = time.monotonic() + 5
    while "d-gone" in generate_latest(service.metrics.registry).decode():
        assert time.monotonic() < deadline, "the series of a forgotten worker stayed"
        service.registry.alive("decode")  # the registry forgets on its reads
        time.sleep(0.05)
