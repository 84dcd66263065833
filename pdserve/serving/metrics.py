"""Prometheus plumbing every role shares: each role keeps its own registry (its metrics live
beside it: pdserve/router/metrics.py, prefill/metrics.py, decode/metrics.py) and serves it
over HTTP at /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384)


def serve_metrics(registry: CollectorRegistry, host: str, port: int = 0) -> int:
    """Start the HTTP endpoint (/metrics); returns the bound port."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port


def latency(registry: CollectorRegistry, name: str, doc: str, labels=()) -> Histogram:
    return Histogram(name, doc, list(labels), buckets=LATENCY_BUCKETS, registry=registry)


def transfer_metrics(registry: CollectorRegistry) -> tuple[Counter, Histogram]:
    """pdserve_transfer_bytes_total{direction} and pdserve_transfer_seconds{direction}, the
    same series on both ends of a KV push (sent on prefill, received on decode)."""
    return (
        Counter("pdserve_transfer_bytes", "KV bytes moved", ["direction"], registry=registry),
        latency(
            registry, "pdserve_transfer_seconds", "KV transfer time per request", ["direction"]
        ),
    )


class Advancing:
    """Counters that follow totals kept elsewhere (the engine core's): add what is new."""

    def __init__(self) -> None:
        self._seen: dict[object, float] = {}

    def advance(self, counter: Counter, total: float) -> None:
        delta = total - self._seen.get(counter, 0)
        if delta > 0:
            counter.inc(delta)
            self._seen[counter] = total


def rank_memory_metrics(registry: CollectorRegistry, ranks) -> None:
    """pdserve_rank_memory_bytes{rank, kind}: what each rank of the worker holds (kind:
    weights, packed_weights, kv), once at start; ranks: EngineCore.memory()."""
    gauge = Gauge(
        "pdserve_rank_memory_bytes",
        "bytes each tensor-parallel rank holds",
        ["rank", "kind"],
        registry=registry,
    )
    for m in ranks:
        gauge.labels(str(m.rank), "weights").set(m.weight_bytes)
        gauge.labels(str(m.rank), "packed_weights").set(m.packed_weight_bytes)
        gauge.labels(str(m.rank), "kv").set(m.kv_bytes)
