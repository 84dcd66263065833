"""The router's Prometheus metrics (its own registry).

pdserve_router_ttft_seconds, pdserve_router_queue_seconds, pdserve_router_e2e_seconds,
pdserve_router_tpot_seconds, pdserve_router_transfer_seconds (push tail per request),
pdserve_router_transfer_bytes_total, pdserve_router_requests_total{outcome} (stop,
length, abort; cancelled: the client went away; failed_<status>: the router gave up;
invalid, rejected), pdserve_router_kv_usage_ratio{worker} (each decode worker, from its
heartbeats; the series goes when the registry forgets the worker),
pdserve_router_resumes_total{stage} (requests resumed after their prefill or decode failed),
pdserve_router_local_prefills_total (prompts their decode worker computed: conditional
disaggregation, RouterConfig.local_prefill_tokens),
pdserve_router_migrations_total{outcome="completed"|"failed"} (live KV moves between decode
workers: pdserve/router/migrate.py), pdserve_router_migration_switch_seconds (the source's
last token -> the destination's first: the stall a migrated request's client sees),
pdserve_router_http_in_process_total (OpenAI front door requests, past its door, that called
the router's Generate in its own process, pdserve/openai/local_call.py, not over gRPC)
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.serving.metrics import latency


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = latency(r, "pdserve_router_ttft_seconds", "time to first token")
        self.queue = latency(r, "pdserve_router_queue_seconds", "admission and reservation wait")
        self.e2e = latency(r, "pdserve_router_e2e_seconds", "request latency")
        self.tpot = latency(
            r, "pdserve_router_tpot_seconds", "decode time per output token of a request"
        )
        self.transfer = latency(
            r,
            "pdserve_router_transfer_seconds",
            "KV push tail per request (last layer computed -> KV in the decode blocks)",
        )
        self.http_in_process = Counter(
            "pdserve_router_http_in_process",
            "front door requests that called Generate in this process (not over gRPC)",
            registry=r,
        )
        self.requests = Counter(
            "pdserve_router_requests", "requests by outcome", ["outcome"], registry=r
        )
        self.transfer_bytes = Counter(
            "pdserve_router_transfer_bytes",
            "KV bytes pushed for this router's requests",
            registry=r,
        )
        self.resumes = Counter(
            "pdserve_router_resumes",
            "requests resumed on another worker, by the stage that failed",
            ["stage"],
            registry=r,
        )
        self.local_prefills = Counter(
            "pdserve_router_local_prefills",
            "prompts sent to their decode worker to compute, not to a prefill worker "
            "(conditional disaggregation: RouterConfig.local_prefill_tokens)",
            registry=r,
        )
        self.migrations = Counter(
            "pdserve_router_migrations",
            "requests whose KV moved to another decode worker, by outcome",
            ["outcome"],
            registry=r,
        )
        self.switch = latency(
            r,
            "pdserve_router_migration_switch_seconds",
            "a migrated request's last token from its old worker -> first from the new",
        )
        self.kv_usage = Gauge(
            "pdserve_router_kv_usage_ratio",
            "used / total KV blocks of each decode worker (last heartbeat)",
            ["worker"],
            registry=r,
        )

    def forget_worker(self, worker_id: str) -> None:
        """A worker left the registry: its series leave /metrics too."""
        with contextlib.suppress(KeyError):
            self.kv_usage.remove(worker_id)
