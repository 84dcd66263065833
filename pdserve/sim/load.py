"""Load and what it does: the requests a run sends, and what each one saw.

    Arrivals(specs, concurrency=8)    closed loop: 8 clients, each sends its next request
                                      when its previous one ends (arrival times ignored)
    Arrivals(specs, concurrency=None) open loop: each request at its arrival_s
    Record                            one request's arrival, first token, end, counters
    summarize(records, ...)           the figures of a run, as `bench sweep` reports them

Real runs (pdserve/bench/sim_vs_real.py) and simulated ones (pdserve/sim) share these, so
their figures are computed the same way.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from pdserve.bench.serve import percentile
from pdserve.bench.slo import SLO
from pdserve.bench.sweep import steady_throughput, warm_throughput
from pdserve.bench.workload import RequestSpec


class Arrivals:
    def __init__(self, specs: list[RequestSpec], concurrency: int | None) -> None:
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
        self.specs = specs
        self.closed = concurrency is not None
        self._next = 0  # closed loop: the next spec to send
        self._due: list[tuple[float, int]] = []  # (time, spec index)
        if self.closed:
            for _ in range(min(concurrency, len(specs))):
                self._send(0.0)
        else:
            self._due = sorted((s.arrival_s, i) for i, s in enumerate(specs))
            self._next = len(specs)

    def _send(self, at: float) -> None:
        if self._next < len(self.specs):
            heapq.heappush(self._due, (at, self._next))
            self._next += 1

    def next_time(self) -> float | None:
        return self._due[0][0] if self._due else None

    def pop_due(self, now: float) -> list[tuple[float, int]]:
        """(arrival time, spec index) of every request due by `now`, in arrival order."""
        out = []
        while self._due and self._due[0][0] <= now:
            out.append(heapq.heappop(self._due))
        return out

    def ended(self, at: float) -> None:
        """A request ended at `at`: in a closed loop its client sends the next one then."""
        if self.closed:
            self._send(at)

    @property
    def exhausted(self) -> bool:
        return not self._due and self._next >= len(self.specs)


@dataclass
class Record:
    request_id: str
    arrival: float  # seconds on the run's clock
    output_target: int
    first: float | None = None
    end: float | None = None
    output_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    where: str = ""  # the replica or decode worker that served it (last)
    moved_tokens: int = 0  # output tokens generated before a live migration (cluster sim)
    migrations: int = 0

    # what bench sweep's steady_throughput reads
    @property
    def sent_at(self) -> float:
        return self.arrival

    @property
    def first_at(self) -> float:
        return self.first if self.first is not None else self.arrival

    @property
    def end_at(self) -> float:
        return self.end if self.end is not None else self.first_at

    @property
    def error(self) -> str | None:
        return None if self.end is not None else "unfinished"

    @property
    def ttft_s(self) -> float:
        return self.first_at - self.arrival

    @property
    def tpot_s(self) -> float:
        n = self.output_tokens
        return (self.end_at - self.first_at) / (n - 1) if n > 1 else 0.0

    @property
    def e2e_s(self) -> float:
        return self.end_at - self.arrival


@dataclass
class Series:
    """Samples over time, thinned to at most `limit` points (every k-th kept)."""

    limit: int = 2000
    points: list[tuple[float, float, float]] = field(default_factory=list)  # (t, kv, bw)
    _every: int = 1
    _seen: int = 0

    def add(self, t: float, kv_usage: float, bandwidth: float) -> None:
        self._seen += 1
        if self._seen % self._every:
            return
        self.points.append((t, kv_usage, bandwidth))
        if len(self.points) >= self.limit:
            self.points = self.points[::2]
            self._every *= 2


def summarize(records: list[Record], slo: SLO, concurrency: int | None = None) -> dict:
    ok = [r for r in records if r.end is not None]
    tokens = sum(r.output_tokens for r in ok)
    start = min((r.arrival for r in records), default=0.0)
    end = max((r.end for r in ok), default=start)
    steady, window = steady_throughput(records)
    warm, warm_window = (
        (None, 0.0) if concurrency is None else warm_throughput(records, concurrency)
    )
    good = [r for r in ok if slo.meets(r.ttft_s, r.tpot_s)]
    elapsed = end - start
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.output_tokens > 1]
    e2e = [r.e2e_s for r in ok]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "elapsed_s": elapsed,
        "generated_tokens": tokens,
        "throughput_tok_s": steady,
        "steady_window_s": window,
        "warm_tok_s": warm,  # closed loop, after the first wave (bench sweep's field)
        "warm_window_s": warm_window,
        "overall_tok_s": tokens / elapsed if elapsed > 0 else 0.0,
        "goodput_req_s": len(good) / elapsed if elapsed > 0 else 0.0,
        "goodput_tok_s": sum(r.output_tokens for r in good) / elapsed if elapsed > 0 else 0.0,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "preemptions": sum(r.preemptions for r in ok),
        "recomputed_tokens": sum(r.recomputed_tokens for r in ok),
    }
