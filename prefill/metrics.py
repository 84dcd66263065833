"""The prefill worker's Prometheus metrics (its own registry).

pdserve_prefill_seconds, pdserve_prefill_queued_tokens, pdserve_prefill_batch_tokens,
pdserve_prefill_turn_budget_tokens (under a CPU lease: prefill/turns.py),
pdserve_prefill_cancelled_total (prompts dropped from the queue: their call was cancelled),
pdserve_transfer_bytes_total{direction="sent"}, pdserve_transfer_seconds{direction="sent"}
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.serving.metrics import TOKEN_BUCKETS, latency, transfer_metrics


class PrefillMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.prefill = latency(
            r,
            "pdserve_prefill_seconds",
            "a batch from its start to its first tokens (in turns at shared CPUs: its waits "
            "for turns and its parts included)",
        )
        self.cancelled = Counter(
            "pdserve_prefill_cancelled",
            "prompts dropped from the queue: their call was cancelled before they ran",
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
        self.turn_budget_tokens = Gauge(
            "pdserve_prefill_turn_budget_tokens",
            "prompt tokens the next batch may take so that its turn at shared CPUs lasts "
            "--turn-s (0 when the worker does not compute in turns)",
            registry=r,
        )
        self.transfer_bytes, self.transfer_seconds = transfer_metrics(r)
