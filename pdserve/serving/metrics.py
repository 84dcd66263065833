"""Prometheus metrics of each role, each in its own registry, served over HTTP.

router:  pdserve_router_ttft_seconds, pdserve_router_queue_seconds, pdserve_router_e2e_seconds,
         pdserve_router_tpot_seconds, pdserve_router_transfer_seconds (push tail per request),
         pdserve_router_transfer_bytes_total, pdserve_router_requests_total{outcome},
         pdserve_router_kv_usage_ratio{worker} (each decode worker, from its heartbeats)
prefill: pdserve_prefill_seconds, pdserve_prefill_queued_tokens, pdserve_prefill_batch_tokens,
         pdserve_transfer_bytes_total{direction="sent"}, pdserve_transfer_seconds{direction="sent"}
decode:  pdserve_decode_tpot_seconds, pdserve_decode_inter_token_seconds,
         pdserve_decode_running, pdserve_decode_kv_usage_ratio,
         pdserve_transfer_bytes_total{direction="received"},
         pdserve_transfer_seconds{direction="received"} (reserve -> KV arrived),
         pdserve_decode_preemptions_total, pdserve_decode_recomputed_tokens_total,
         pdserve_decode_admission_refused_total,
         pdserve_decode_spilled_bytes_total{tier}, pdserve_decode_reloaded_bytes_total{tier},
         pdserve_decode_spill_used_blocks{tier}
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384)


def serve_metrics(registry: CollectorRegistry, host: str, port: int = 0) -> int:
    """Start the HTTP endpoint (/metrics); returns the bound port."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port


def _transfer(registry: CollectorRegistry) -> tuple[Counter, Histogram]:
    return (
        Counter("pdserve_transfer_bytes", "KV bytes moved", ["direction"], registry=registry),
        Histogram(
            "pdserve_transfer_seconds",
            "KV transfer time per request",
            ["direction"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ),
    )


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "pdserve_router_ttft_seconds",
            "time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "pdserve_router_queue_seconds",
            "admission and reservation wait",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_router_e2e_seconds", "request latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.requests = Counter(
            "pdserve_router_requests", "requests by outcome", ["outcome"], registry=r
        )
        self.tpot = Histogram(
            "pdserve_router_tpot_seconds",
            "decode time per output token of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer = Histogram(
            "pdserve_router_transfer_seconds",
            "KV push tail per request (last layer computed -> KV in the decode blocks)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "pdserve_router_transfer_bytes",
            "KV bytes pushed for this router's requests",
            registry=r,
        )
        self.kv_usage = Gauge(
            "pdserve_router_kv_usage_ratio",
            "used / total KV blocks of each decode worker (last heartbeat)",
            ["worker"],
            registry=r,
        )


class PrefillMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.prefill = Histogram(
            "pdserve_prefill_seconds",
            "prompt forward pass per batch",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queued_tokens = Gauge(
            "pdserve_prefill_queued_tokens", "prompt tokens waiting", registry=r
        )
        self.batch_tokens = Histogram(
            "pdserve_prefill_batch_tokens",
            "prompt tokens per batch",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.transfer_bytes, self.transfer_seconds = _transfer(r)


class DecodeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tpot = Histogram(
            "pdserve_decode_tpot_seconds",
            "mean time per output token of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_decode_inter_token_seconds",
            "time between a request's tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("pdserve_decode_running", "requests in the running batch", registry=r)
        self.kv_usage = Gauge("pdserve_decode_kv_usage_ratio", "used / total KV blocks", registry=r)
        self.transfer_bytes, self.transfer_seconds = _transfer(r)
        self.preemptions = Counter(
            "pdserve_decode_preemptions", "running requests preempted", registry=r
        )
        self.recomputed = Counter(
            "pdserve_decode_recomputed_tokens",
            "tokens whose KV was dropped and computed again",
            registry=r,
        )
        self.refused = Counter(
            "pdserve_decode_admission_refused", "reservations refused by admission", registry=r
        )
        self.spilled = Counter(
            "pdserve_decode_spilled_bytes", "KV bytes spilled, per tier", ["tier"], registry=r
        )
        self.reloaded = Counter(
            "pdserve_decode_reloaded_bytes", "KV bytes reloaded, per tier", ["tier"], registry=r
        )
        self.spill_used = Gauge(
            "pdserve_decode_spill_used_blocks",
            "blocks held in each spill tier",
            ["tier"],
            registry=r,
        )
        self._seen: dict[str, float] = {}

    def _advance(self, counter, key: str, total: float) -> None:
        """Counters follow totals kept elsewhere: add what is new since the last call."""
        delta = total - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._seen[key] = total

    def account_preemption(self, scheduler, spiller) -> None:
        self._advance(self.preemptions, "preemptions", scheduler.preemptions)
        self._advance(self.recomputed, "recomputed", scheduler.recomputed_tokens)
        if spiller is None:
            return
        for tier, st in spiller.store.stats().items():
            self._advance(self.spilled.labels(tier), f"spilled:{tier}", st["spilled_bytes"])
            self._advance(self.reloaded.labels(tier), f"reloaded:{tier}", st["reloaded_bytes"])
            self.spill_used.labels(tier).set(st["used_blocks"])
