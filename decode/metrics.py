"""The decode worker's Prometheus metrics (its own registry).

pdserve_decode_tpot_seconds, pdserve_decode_inter_token_seconds, pdserve_decode_running,
pdserve_decode_kv_usage_ratio, pdserve_transfer_bytes_total{direction="received"},
pdserve_transfer_seconds{direction="received"} (reserve -> KV arrived),
pdserve_decode_preemptions_total, pdserve_decode_recomputed_tokens_total,
pdserve_decode_admission_refused_total, pdserve_decode_spilled_bytes_total{tier},
pdserve_decode_reloaded_bytes_total{tier}, pdserve_decode_spill_used_blocks{tier}
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.engine.output import EngineStats
from pdserve.serving.metrics import Advancing, latency, transfer_metrics


class DecodeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tpot = latency(
            r, "pdserve_decode_tpot_seconds", "mean time per output token of a request"
        )
        self.itl = latency(
            r, "pdserve_decode_inter_token_seconds", "time between a request's tokens"
        )
        self.running = Gauge("pdserve_decode_running", "requests in the running batch", registry=r)
        self.kv_usage = Gauge("pdserve_decode_kv_usage_ratio", "used / total KV blocks", registry=r)
        self.transfer_bytes, self.transfer_seconds = transfer_metrics(r)
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
        self._totals = Advancing()

    def account(self, stats: EngineStats) -> None:
        """Gauges and counters from the engine core's state after a step."""
        pool = stats.pool
        self.running.set(stats.running)
        self.kv_usage.set(pool.used_blocks / pool.num_blocks)
        self._totals.advance(self.preemptions, stats.preemptions)
        self._totals.advance(self.recomputed, stats.recomputed_tokens)
        if pool.offloaded is None:
            return
        for tier, st in pool.offloaded.tiers.items():
            self._totals.advance(self.spilled.labels(tier), st["spilled_bytes"])
            self._totals.advance(self.reloaded.labels(tier), st["reloaded_bytes"])
            self.spill_used.labels(tier).set(st["used_blocks"])
