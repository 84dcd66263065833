"""`pdserve bench serve`: a client-side load generator against a router.

Starts a local cluster (or uses `--address`), sends requests at a fixed concurrency or as a
Poisson process, and reports throughput and TTFT/TPOT percentiles as the client saw them,
plus the per-stage timings the cluster returned (router queue, prefill, KV transfer,
decode-side TPOT). Router overhead per token = client-observed TPOT - decode-side TPOT of the
same request (the decode worker timestamps its own emissions), reported at p50.

Workloads: request lengths from `pdserve.bench.offline` (Azure 2023 or Mooncake traces scaled
to a small model, or uniform), prompt token ids drawn at random. `--replay` sends a trace's
requests at its recorded arrival times (divided by `--time-scale`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.bench.report import machine_info
from pdserve.bench.slo import SLO, goodput
from pdserve.bench.traces import trace_requests
from pdserve.bench.workload import TRACE_SCALES, Workload, make_workload, scale_lengths
from pdserve.progress import progress
from pdserve.trace import Span, write_jsonl
from pdserve.trace import coverage as trace_coverage


@dataclass
class Sample:
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    tpot_s: float = 0.0  # client-observed mean time per output token after the first
    e2e_s: float = 0.0
    server: dict = field(default_factory=dict)
    error: str | None = None
    trace: dict | None = None  # pdserve.trace record; written to --trace, not to the JSON
    # perf_counter() readings: sent, first token, last token (for windowed throughput)
    sent_at: float = 0.0
    first_at: float = 0.0
    end_at: float = 0.0
    token_times: list[float] = field(default_factory=list)  # perf_counter() of every token

    def record(self) -> dict:
        """The per-request record a report keeps (any SLO can be applied to it later)."""
        return {
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "max_gap_s": self.max_gap_s,
            "error": self.error,
        }

    @property
    def max_gap_s(self) -> float | None:
        """The longest wait between two of its tokens (a stall: a preemption, a prefill turn)
        -> seconds; None when fewer than two token times were seen."""
        t = self.token_times
        return max((b - a for a, b in zip(t, t[1:])), default=None)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


@dataclass(frozen=True)
class Midway:
    """A call made once during a run, on a thread while the load goes on: after `count`
    requests were sent, or (`started`) after `count` of them had their first token."""

    call: Callable[[], None]
    count: int
    started: bool = False


async def _one(client, prompt: list[int], max_tokens: int, on_first=None) -> Sample:
    import grpc

    from pdserve.client import build_request, timings_of
    from pdserve.serving.convert import spans_from_proto

    sample = Sample(prompt_tokens=len(prompt))
    start = time.perf_counter()
    first = last = None
    try:
        result = None
        params = dict(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        call = client.stub.Generate(build_request(prompt, params), metadata=client.metadata)
        async for msg in call:
            now = time.perf_counter()
            if msg.token_ids:
                sample.output_tokens += len(msg.token_ids)
                sample.token_times += [now] * len(msg.token_ids)
                if first is None and on_first is not None:
                    on_first()
                first = first or now
                last = now
            if msg.finished:
                result = msg.timings
                sample.trace = {
                    "request_id": msg.request_id,
                    "arrival": result.arrival_unix,
                    "end": result.end_unix,
                    "spans": [s.to_dict() for s in spans_from_proto(msg.trace)],
                }
        sample.e2e_s = time.perf_counter() - start
        sample.sent_at, sample.first_at = start, first or start
        sample.end_at = last or sample.first_at
        sample.ttft_s = (first or start) - start
        if sample.output_tokens > 1:
            sample.tpot_s = (last - first) / (sample.output_tokens - 1)
        if result is not None:
            sample.server = timings_of(result)
    except grpc.RpcError as e:  # recorded per request and counted in the report
        sample.error = f"{e.code().name}: {e.details()}"
    return sample


async def _drive(address, work, concurrency, rate, seed, arrivals=None, midway=None):
    """-> (samples, elapsed s). `arrivals` (seconds from start) replays a trace's timing.
    `midway` (a Midway) runs once, when its count is reached."""
    from pdserve.client import AsyncClient

    client = AsyncClient(address)
    samples: list[Sample] = []
    bar = progress(total=len(work.prompts), desc="bench serve", unit="req")
    rng = random.Random(seed)
    start = time.perf_counter()
    counts, pending = {"sent": 0, "started": 0}, []

    def count(kind: str) -> None:
        counts[kind] += 1
        watched = midway is not None and kind == ("started" if midway.started else "sent")
        if watched and counts[kind] == midway.count:
            pending.append(asyncio.get_running_loop().run_in_executor(None, midway.call))

    def one(prompt, max_tokens):
        return _one(client, prompt, max_tokens, lambda: count("started"))

    if rate or arrivals is not None:
        tasks = []
        for i, (prompt, max_tokens) in enumerate(zip(work.prompts, work.max_tokens)):
            if arrivals is not None:
                await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            count("sent")
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
            tasks[-1].add_done_callback(lambda _: bar.update(1))
            if arrivals is None:
                await asyncio.sleep(rng.expovariate(rate))
        samples = list(await asyncio.gather(*tasks))
    else:
        queue = list(zip(work.prompts, work.max_tokens))

        async def worker():
            while queue:
                prompt, max_tokens = queue.pop(0)
                count("sent")
                samples.append(await one(prompt, max_tokens))
                bar.update(1)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    for call in pending:
        await call  # its error, if any, is the benchmark's
    await client.close()
    return samples, elapsed


def summarize(samples: list[Sample], elapsed: float, slo: SLO | None = None) -> dict:
    ok = [s for s in samples if s.error is None]
    tokens = sum(s.output_tokens for s in ok)
    slo = slo or SLO()
    good_req_s, good_tok_s = goodput([s.record() for s in samples], slo, elapsed)
    e2e = [s.e2e_s for s in ok]

    def pcts(values):
        return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}

    overhead = [
        s.tpot_s - s.server["tpot_s"] for s in ok if s.output_tokens > 1 and s.server.get("tpot_s")
    ]
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "error_examples": sorted({s.error for s in samples if s.error})[:3],
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / elapsed if elapsed else 0.0,
        "ttft_s": pcts([s.ttft_s for s in ok]),
        "tpot_s": pcts([s.tpot_s for s in ok if s.output_tokens > 1]),
        "e2e_s": pcts(e2e),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "slo": slo.to_dict(),
        "goodput_req_s": good_req_s,
        "goodput_tok_s": good_tok_s,
        "stages": {
            key: pcts([s.server[key] for s in ok if s.server])
            for key in ("queue_s", "prefill_s", "transfer_s", "tpot_s")
        },
        "router_overhead_per_token_s": pcts(overhead),
    }


def bench_serve(
    model: str,
    address: str | None = None,
    prefill: int = 1,
    decode: int = 1,
    requests: int = 32,
    concurrency: int = 8,
    rate: float | None = None,
    workload: str = "azure-conv",
    seed: int = 0,
    worker_args: list[str] | None = None,
    replay: bool = False,
    time_scale: float = 1.0,
    trace_path: str | None = None,
    slo: SLO | None = None,
    share_cpus: bool | None = None,
    router_idle: bool | None = None,
) -> dict:
    """`replay`: the trace's first `requests` requests, in order, at their recorded arrival
    times divided by `time_scale` (lengths scaled as in the workload). `trace_path`: write
    every request's spans there as JSON lines (see pdserve.trace; `pdserve trace` plots)."""
    from pdserve.launch import Cluster
    from pdserve.weights import resolve

    vocab = resolve(model).config.vocab_size
    arrivals = None
    if replay:
        if workload not in TRACE_SCALES:
            raise ValueError(f"workload: replay needs a trace ({', '.join(TRACE_SCALES)})")
        if time_scale <= 0:
            raise ValueError(f"time_scale: must be > 0, got {time_scale}")
        trace = trace_requests(workload)[:requests]
        gen = torch.Generator().manual_seed(seed)
        prompts, max_tokens = [], []
        for r in trace:
            p, o = scale_lengths(workload, r.prompt_tokens, r.output_tokens)
            prompts.append(torch.randint(vocab // 4, vocab, (p,), generator=gen).tolist())
            max_tokens.append(o)
        work = Workload(prompts, max_tokens)
        arrivals = [r.arrival_s / time_scale for r in trace]
    else:
        work = make_workload(requests, vocab, seed, workload)
    cluster = None
    if address is None:
        cluster = Cluster(
            model,
            prefill,
            decode,
            worker_args=worker_args,
            share_cpus=share_cpus,
            router_idle=router_idle,
        )
        address = cluster.address
    cpus = cluster.cpus() if cluster is not None else {}
    try:
        samples, elapsed = asyncio.run(_drive(address, work, concurrency, rate, seed, arrivals))
    finally:
        if cluster is not None:
            cluster.close()
    records = [s.trace for s in samples if s.trace is not None]
    if trace_path is not None:
        write_jsonl(trace_path, records)
    coverage = [
        trace_coverage([Span(**x) for x in r["spans"]], r["arrival"], r["end"]) for r in records
    ]
    return {
        "benchmark": "serve",
        "model": model,
        "cluster": {
            "prefill": prefill,
            "decode": decode,
            "address": address,
            **cpus,
        },
        "load": {
            "requests": len(work.prompts),
            "concurrency": None if (rate or replay) else concurrency,
            "rate": rate,
            "replay_time_scale": time_scale if replay else None,
        },
        "workload": {"kind": workload, "seed": seed},
        "machine": machine_info(),
        "summary": summarize(samples, elapsed, slo),
        "trace_coverage": {f"p{q}": percentile(coverage, q) for q in (0, 50, 100)},
        "samples": [
            {k: v for k, v in s.__dict__.items() if k not in ("trace", "token_times")}
            | {"max_gap_s": s.max_gap_s}
            for s in samples
        ],
    }


def format_table(report: dict) -> str:
    s = report["summary"]
    load = report["load"]
    if load["replay_time_scale"]:
        mode = f"trace arrival times / {load['replay_time_scale']}"
    elif load["rate"]:
        mode = f"rate {load['rate']}/s"
    else:
        mode = f"concurrency {load['concurrency']}"
    ms = lambda d: " ".join(f"{k} {v * 1e3:8.2f}" for k, v in d.items())  # noqa: E731
    lines = [
        f"serve: {report['model']}, {report['cluster']['prefill']}P{report['cluster']['decode']}D, "
        f"{s['requests']} requests at {mode} ({report['workload']['kind']})",
        f"throughput {s['throughput_tok_s']:.1f} output tok/s over {s['elapsed_s']:.1f}s, "
        f"errors {s['errors']}",
        f"client  TTFT ms  {ms(s['ttft_s'])}",
        f"client  TPOT ms  {ms(s['tpot_s'])}",
        f"router  queue ms {ms(s['stages']['queue_s'])}",
        f"prefill ms       {ms(s['stages']['prefill_s'])}",
        f"transfer ms      {ms(s['stages']['transfer_s'])}",
        f"decode  TPOT ms  {ms(s['stages']['tpot_s'])}",
        f"router overhead per token ms {ms(s['router_overhead_per_token_s'])}",
        f"SLO goodput {s['goodput_req_s']:.2f} req/s, {s['goodput_tok_s']:.1f} tok/s "
        f"(TTFT <= {s['slo']['ttft_s']:g} s, TPOT <= {s['slo']['tpot_s']:g} s)",
    ]
    return "\n".join(lines)
