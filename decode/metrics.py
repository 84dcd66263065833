"""The decode worker's Prometheus metrics (its own registry).

pdserve_decode_tpot_seconds, pdserve_decode_inter_token_seconds, pdserve_decode_running,
pdserve_decode_kv_usage_ratio, pdserve_transfer_bytes_total{direction="received"},
pdserve_transfer_seconds{direction="received"} (reserve -> KV arrived),
pdserve_decode_preemptions_total, pdserve_decode_rotations_total (parked requests brought
back by parking running ones: each counts its victims as preemptions too),
pdserve_decode_recomputed_tokens_total, pdserve_decode_local_prefills_total (prompts computed
here, not pushed: conditional disaggregation, docs/architecture.md),
pdserve_decode_admission_refused_total, pdserve_decode_spilled_bytes_total{tier},
pdserve_decode_reloaded_bytes_total{tier}, pdserve_decode_spill_used_blocks{tier},
pdserve_decode_reservations{state="held"|"fenced"} (reservations waiting for their push, and
ended ones whose blocks wait until their push can no longer land: decode/reservations.py)

Token delivery: pdserve_decode_stream_messages_total{path="feed"|"stream"} (messages sent: a
feed's one a step for all its streams, decode/feed.py, or a stream's one a token),
pdserve_decode_feeds_open (callers' feed calls open now)

Live migration, on the worker a request leaves (decode/migrate.py):
pdserve_decode_migrations_total{outcome="completed"|"failed"}, pdserve_decode_migrated_bytes_total,
pdserve_decode_migration_rounds (pre-copy rounds per move, the last included),
pdserve_decode_migration_stall_seconds (the request stopped here -> its last WRITE complete),
pdserve_decode_migration_staging_kept_bytes (parked KV staged for moves that failed after
posting, kept while a WRITE may still read it: transfer/retiring.py; rank 0's).

Every gauge is set after each change of the books (reserve, release, a step, an expiry).

The cost-aware admission policy's inputs at its last look (pdserve/engine/admission.py; -1 while
not measured yet): pdserve_decode_policy_step_seconds,
pdserve_decode_policy_recompute_seconds_per_token,
pdserve_decode_policy_park_seconds_per_block{tier}, pdserve_decode_policy_overcommit_blocks
(R), pdserve_decode_policy_demand_blocks (D_peak), pdserve_decode_policy_demand_sd_blocks,
pdserve_decode_policy_tier_free_blocks, pdserve_decode_policy_rotation_steps_per_block,
pdserve_decode_policy_longest_stall_steps.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from decode.reservations import Reservations
from pdserve.engine.admission import PolicyInputs
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
        self.reservations = Gauge(
            "pdserve_decode_reservations",
            "reservations held (push not arrived) and fenced (ended, push may still land)",
            ["state"],
            registry=r,
        )
        self.transfer_bytes, self.transfer_seconds = transfer_metrics(r)
        self.stream_messages = Counter(
            "pdserve_decode_stream_messages",
            "token messages sent: on a caller's feed (a step's, all its streams) or a stream",
            ["path"],
            registry=r,
        )
        self.feeds_open = Gauge("pdserve_decode_feeds_open", "feed calls open", registry=r)
        self.preemptions = Counter(
            "pdserve_decode_preemptions", "running requests preempted", registry=r
        )
        self.local_prefills = Counter(
            "pdserve_decode_local_prefills",
            "prompts computed here instead of on a prefill worker (conditional disaggregation)",
            registry=r,
        )
        self.rotations = Counter(
            "pdserve_decode_rotations",
            "parked requests brought back by parking running ones (their turn)",
            registry=r,
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
        self.migrations = Counter(
            "pdserve_decode_migrations",
            "requests moved to another decode worker, by outcome",
            ["outcome"],
            registry=r,
        )
        self.migrated_bytes = Counter(
            "pdserve_decode_migrated_bytes", "KV bytes moved by migrations", registry=r
        )
        self.migration_rounds = Histogram(
            "pdserve_decode_migration_rounds",
            "pre-copy rounds of a completed migration",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16),
            registry=r,
        )
        self.migration_stall = latency(
            r,
            "pdserve_decode_migration_stall_seconds",
            "a migrating request stopped here -> its last WRITE complete",
        )
        self.staging_kept = Gauge(
            "pdserve_decode_migration_staging_kept_bytes",
            "staged KV of failed moves kept while a WRITE may still read it",
            registry=r,
        )
        self._totals = Advancing()
        self.policy: dict[str, Gauge] = {}  # made on first use: a cost-aware worker only

    def account(self, stats: EngineStats, reservations: Reservations) -> None:
        """Gauges and counters from the engine core's state and the reservations."""
        pool = stats.pool
        self.reservations.labels("held").set(len(reservations))
        self.reservations.labels("fenced").set(reservations.fenced)
        self.running.set(stats.running)
        self.kv_usage.set(pool.used_blocks / pool.num_blocks)
        self._totals.advance(self.preemptions, stats.preemptions)
        self._totals.advance(self.rotations, stats.rotations)
        self._totals.advance(self.recomputed, stats.recomputed_tokens)
        if pool.offloaded is None:
            return
        for tier, st in pool.offloaded.tiers.items():
            self._totals.advance(self.spilled.labels(tier), st["spilled_bytes"])
            self._totals.advance(self.reloaded.labels(tier), st["reloaded_bytes"])
            self.spill_used.labels(tier).set(st["used_blocks"])

    def account_policy(self, inputs: PolicyInputs | None) -> None:
        """The cost-aware policy's inputs (None: the worker runs another policy, and
        exports none of these)."""
        if inputs is None:
            return
        if not self.policy:
            self._make_policy_gauges()
        for name, gauge in self.policy.items():
            value = getattr(inputs, name)
            gauge.set(-1.0 if value is None else value)
        for tier, value in inputs.park_s_per_block.items():
            self.park_cost.labels(tier).set(-1.0 if value is None else value)

    def _make_policy_gauges(self) -> None:
        r = self.registry
        self.policy = {
            name: Gauge(f"pdserve_decode_policy_{metric}", doc, registry=r)
            for name, metric, doc in (
                ("step_s", "step_seconds", "a decode step's time (EWMA)"),
                (
                    "recompute_s_per_token",
                    "recompute_seconds_per_token",
                    "what a recomputed token adds to a step (mixed steps' added time over "
                    "their prompt tokens, a 16,384-token half-life)",
                ),
                (
                    "overcommit_blocks",
                    "overcommit_blocks",
                    "R: demand allowed above the pool's budget, as the headroom reported "
                    "to the router counts it (at most 0: below 0, the spread of the demand "
                    "the tiers cannot hold, kept in the pool); a Reserve that finds no line "
                    "at the router may be admitted past the expected peak by what the tiers "
                    "hold",
                ),
                ("demand_blocks", "demand_blocks", "projected demand of the held requests"),
                ("demand_sd_blocks", "demand_sd_blocks", "its standard deviation"),
                ("tier_free_blocks", "tier_free_blocks", "free blocks in the spill tiers"),
                (
                    "rotation_steps_per_block",
                    "rotation_steps_per_block",
                    "steps a request runs per block it holds before it can rotate out",
                ),
                (
                    "longest_stall_steps",
                    "longest_stall_steps",
                    "steps the longest-waiting preempted request has waited",
                ),
            )
        }
        self.park_cost = Gauge(
            "pdserve_decode_policy_park_seconds_per_block",
            "spill + reload seconds per block, per tier",
            ["tier"],
            registry=r,
        )
