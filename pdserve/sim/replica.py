"""Colocated engine replicas under load, on a wall clock (the real engine) or on virtual
clocks (the simulator), driven by the same code.

    Replica(name, core, admission)   one engine core behind the colocated LLM's admission
                                     gate (pdserve/engine/gate.py): requests wait until
                                     its policy lets them in; greedy lets every request
                                     straight into the engine's own queue
    run_real(replica, specs, ...)    the real engine: one step at a time on the wall clock
    run_sim(replicas, specs, ...)    simulated replicas (DP=N): each steps on its own virtual
                                     clock, events in time order; a request goes to the
                                     replica with the most headroom (or round-robin)

A simulated step is the core's begin_step() at the replica's clock, run() (the cost model
says how long), and end_step() when that time has passed: what arrives meanwhile sees the
engine mid-step, as it would.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable

from pdserve.bench.workload import RequestSpec
from pdserve.engine.core import EngineCore, StepPlan
from pdserve.engine.gate import AdmissionGate
from pdserve.engine.output import StepOutput
from pdserve.engine.request import Request
from pdserve.progress import progress
from pdserve.sim.cost import StepWork
from pdserve.sim.engine import SimEngine
from pdserve.sim.load import Arrivals, Record, Series
from pdserve.sim.runner import request_params

ROUTES = ("headroom", "round-robin")


class Replica:
    """One engine core behind its admission gate (pdserve/engine/gate.py), with the records
    and the pool's time series a run reports."""

    def __init__(self, name: str, core: EngineCore, admission=None) -> None:
        self.name, self.core = name, core
        self.gate = AdmissionGate(core, admission)
        self.records: dict[str, Record] = {}
        self.series = Series()

    @property
    def pending(self):
        return self.gate.pending

    def offer(self, req: Request, record: Record) -> None:
        record.where = self.name
        self.records[req.request_id] = record
        self.gate.offer(req)

    def admit(self) -> None:
        self.gate.admit()

    def headroom(self) -> tuple[int, int]:
        """What a router ranks replicas by: projected free blocks, then fewest waiting."""
        return self.gate.headroom(), -len(self.gate.pending)

    def stepped(self, plan: StepPlan, seconds: float) -> None:
        """A step's run took `seconds` (the cost-aware policy learns its costs from it)."""
        self.gate.stepped(plan, seconds)

    @property
    def busy(self) -> bool:
        return self.gate.busy

    def account(self, out: StepOutput, at: float, ended: Callable[[float], None]) -> None:
        for new in out.tokens:
            r = self.records[new.request_id]
            if r.first is None:
                r.first = at
        for done in out.finished:
            r = self.records[done.request_id]
            r.end = at
            r.output_tokens = len(done.output_token_ids)
            r.preemptions = done.metrics.preemptions
            r.recomputed_tokens = done.metrics.recomputed_tokens
            self.gate.finished(done)
            ended(at)


def _request(
    core: EngineCore,
    index: int,
    spec: RequestSpec,
    prompt: list[int],
    cap: int | None = None,
    vocab_size: int = 0,
) -> Request:
    """The spec as a request: its length as max_tokens, or hidden under the cap (a simulated
    engine only, whose runner samples the stop token: pdserve/sim/runner.py)."""
    params = request_params(len(prompt), spec.output_tokens, cap, vocab_size)
    return core.make_request(prompt, params, request_id=f"r{index}")


def run_real(
    replica: Replica,
    specs: list[RequestSpec],
    prompts: list[list[int]],
    concurrency: int | None,
    step_log: list[StepOutput] | None = None,
    label: str = "real",
    samples: list[tuple[StepWork, float]] | None = None,
) -> list[Record]:
    """The real engine on the wall clock (seconds from the run's start). `samples` collects
    each step's work and its cycle time: from the previous step's end when the engine ran
    back to back (what this loop adds between steps counts), else from its own start."""
    arrivals = Arrivals(specs, concurrency)
    core = replica.core
    t0 = time.monotonic()
    last_end: float | None = None
    with progress(total=len(specs), desc=label, unit="req", disable=not label) as bar:

        def ended(at: float) -> None:
            arrivals.ended(at)
            bar.update(1)

        while not arrivals.exhausted or replica.busy:
            now = time.monotonic() - t0
            for at, i in arrivals.pop_due(now):
                replica.offer(_request(core, i, specs[i], prompts[i]), Record(f"r{i}", at, 0))
            replica.admit()
            began = time.monotonic() - t0
            plan = core.begin_step()
            if plan is not None:
                ran = time.monotonic()
                result = core.run(plan)
                replica.stepped(plan, time.monotonic() - ran)
                out = core.end_step(plan, result)
                end = time.monotonic() - t0
                if samples is not None:
                    start = last_end if last_end is not None else began
                    samples.append((StepWork.of(plan.batch.chunks), end - start))
                last_end = end
                if step_log is not None:
                    step_log.append(out)
                replica.account(out, end, ended)
                continue
            last_end = None
            if replica.pending and not core.has_unfinished:
                raise RuntimeError("requests wait but the engine holds nothing to run")
            wait = arrivals.next_time()
            if wait is not None:
                time.sleep(max(0.0, wait - (time.monotonic() - t0)))
    return list(replica.records.values())


def run_sim(
    replicas: list[tuple[Replica, SimEngine]],
    specs: list[RequestSpec],
    prompts: list[list[int]],
    concurrency: int | None,
    route: str = "headroom",
    bandwidth_bytes_s: float = 0.0,
    step_log: list[StepOutput] | None = None,
    label: str = "sim",
    max_tokens: int | None = None,
) -> tuple[list[Record], int]:
    """Simulated replicas on virtual clocks -> (records, steps simulated); `max_tokens`: every
    request's cap, its length hidden (None: its length is its max_tokens)."""
    if route not in ROUTES:
        raise ValueError(f"route: {route!r}; choose one of {', '.join(ROUTES)}")
    arrivals = Arrivals(specs, concurrency)
    events: list[tuple[float, int, int, StepPlan | None]] = []  # (time, seq, replica, plan)
    seq = itertools.count()
    idle = set(range(len(replicas)))  # replicas with no step in flight
    rr = itertools.count()
    steps = 0
    bar_args = dict(desc=label, unit="req", disable=not label, leave=False)
    with progress(total=len(specs), **bar_args) as bar:

        def ended(at: float) -> None:
            arrivals.ended(at)
            bar.update(1)

        def arrive(now: float) -> None:
            for at, i in arrivals.pop_due(now):
                if route == "round-robin":
                    k = next(rr) % len(replicas)
                else:
                    k = max(range(len(replicas)), key=lambda j: replicas[j][0].headroom())
                rep, eng = replicas[k]
                request = _request(eng.core, i, specs[i], prompts[i], max_tokens, eng.runner.vocab)
                rep.offer(request, Record(f"r{i}", at, 0))

        def start_steps(now: float) -> None:
            for k in sorted(idle):
                rep, eng = replicas[k]
                eng.clock.now = max(eng.clock.now, now)
                rep.admit()
                plan = eng.core.begin_step()
                if plan is None:
                    if rep.pending and not eng.core.has_unfinished:
                        raise RuntimeError(f"{rep.name}: requests wait, the engine holds none")
                    continue
                result = eng.core.run(plan)
                idle.discard(k)
                heapq.heappush(
                    events, (eng.clock.now + eng.runner.last_seconds, next(seq), k, (plan, result))
                )

        now = 0.0
        arrive(now)
        start_steps(now)
        while events or not arrivals.exhausted:
            nxt = arrivals.next_time()
            if events and (nxt is None or events[0][0] <= nxt):
                now, _, k, (plan, result) = heapq.heappop(events)
                rep, eng = replicas[k]
                elapsed = now - eng.clock.now
                eng.clock.now = now
                out = eng.core.end_step(plan, result)
                rep.stepped(plan, elapsed)
                steps += 1
                if step_log is not None:
                    step_log.append(out)
                rep.account(out, now, ended)
                pool = eng.core.stats().pool
                bw = (
                    eng.runner.last_bytes / elapsed / bandwidth_bytes_s
                    if bandwidth_bytes_s and elapsed
                    else 0.0
                )
                rep.series.add(now, pool.used_blocks / pool.num_blocks, bw)
                idle.add(k)
            else:
                now = nxt
            arrive(now)
            start_steps(now)
    records = [r for rep, _ in replicas for r in rep.records.values()]
    return records, steps
