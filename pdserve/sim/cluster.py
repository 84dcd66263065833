"""A disaggregated cluster on virtual time: the router's registry and worker choice, decode
workers' books (admission, reservations, the engine core) and prefill workers' batching,
all the real classes, wired by events instead of gRPC and NIXL.

    arrive      the router asks decode workers to Reserve, the one with the most headroom
                first (WorkerRegistry.pick_decode, as pdserve/router/handoff.py does), in
                the router's line (pdserve/router/line.py, the same class, asked without
                waiting): everyone asks until someone is refused everywhere, then only the
                line's head, again when a request ends or a heartbeat comes (a kick), at
                the latest after the router's backoff (10 ms doubling to 200 ms; a kick
                starts it over), until the line empties
    prefill     the prefill worker with the fewest queued tokens gets the prompt; its batcher
                forms batches under the token budget (prefill/batcher.py); a batch takes its
                cost model's time, then its push: the link's bytes/s, all of it after the
                forward pass on CPU (pdserve's `--kv-push auto`), only the last layer's
                share past it on GPU (layer-wise, overlapped)
    start       the decode worker admits the request (DecodeState.start); its first token
                is the client's first token
    step        each decode worker steps on its own clock (begin_step, its cost, end_step)
    heartbeat   every heartbeat interval each worker's stats refresh the registry, which
                between heartbeats counts what the router itself sent (as a real router does)

With `migrate` (a `+migrate` policy) the router's rebalancer runs every
`rebalance_period_s` and moves requests between decode workers (pdserve/sim/migrate.py).
With `skew="late-join"` every decode worker but the first takes no new requests until half
the requests arrived (WorkerRegistry.drain, as `pdserve drain` does), as in the sweep; with
`skew="scale-out"` (closed loop) until the first wave, one request per client, started.

The handoff's calls cost what the profile's `handoff` says (reserve, the prefill call's
transit, start); the decode worker's steps and the prefill batches cost what its `cluster`
and `cluster_prefill` coefficients (or the roofline) say.

With a profile whose workers share the CPUs (`shares_cpus`: measured on a cluster launched
in turns, pdserve/serving/cpu_lease.py) the workers take turns as the lease makes them: a
prefill batch's forward pass holds every CPU alone, decode steps overlap one another; a
decode step does not start while a prefill batch waits (the lease's gate), the waiting
decode workers step once before the next prefill batch (its handover), and a prefill
worker sizes its batches by time as the real one does, a lone prompt longer than a turn a
part per turn (prefill/turns.py; `Setup.turn_s`). A step's cost starts when its turn does.
A decode step costs what the profile measured with as many decode workers on the node
(`Profile.cluster_decode`: a launched 1P2D splits the CPUs between its decode workers, and
`sim calibrate --cluster` fits its steps apart); whether the other decode worker is
stepping at the same moment is not modelled (its calibration's steps mostly overlapped).
Not modelled either: a shared turn's release waits up to 50 ms for a waiting prefill batch
to take the lease (the real step's tokens go out after it).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from decode.config import DecodeConfig
from decode.state import DecodeState, ReservationError
from pdserve.bench.workload import RequestSpec
from pdserve.engine.admission import waiting_per_worker
from pdserve.engine.args import EngineArgs
from pdserve.engine.batch import RunResult
from pdserve.engine.core import StepPlan
from pdserve.progress import progress
from pdserve.router.config import RouterConfig
from pdserve.router.line import ReserveLine, Ticket
from pdserve.router.registry import WorkerRecord, WorkerRegistry
from pdserve.sampling_params import SamplingParams
from pdserve.serving.destination import Destination
from pdserve.serving.registration import WorkerStats
from pdserve.sim.clock import VirtualClock
from pdserve.sim.engine import SimEngine, sim_engine
from pdserve.sim.load import Arrivals, Record, Series
from pdserve.sim.migrate import SimMigrations
from pdserve.sim.runner import request_params
from prefill.batcher import Batcher, PrefillJob, reserve_batch
from prefill.turns import TurnBudget


@dataclass
class _Decode:
    name: str
    engine: SimEngine
    state: DecodeState
    busy: bool = False
    series: Series = field(default_factory=Series)
    waiting: StepPlan | None = None  # its next step, planned, waiting for a CPU turn


@dataclass
class _Prefill:
    name: str
    engine: SimEngine
    batcher: Batcher
    queued: int = 0  # prompt tokens waiting (what its heartbeat reports)
    jobs: int = 0  # jobs in the batcher
    busy: bool = False
    turns: TurnBudget | None = None  # batches sized by time, in turns at shared CPUs
    waiting: list[PrefillJob] | None = None  # its formed batch waiting for a CPU turn
    parts: int = 0  # tokens of its lone prompt computed in earlier turns


@dataclass
class _CpuTurns:
    """Who computes at a node's shared CPUs (pdserve/serving/cpu_lease.py's rules)."""

    prefill: _Prefill | None = None  # holding every CPU for a batch
    decoding: int = 0  # decode steps running side by side
    prefill_line: deque[_Prefill] = field(default_factory=deque)  # prefill workers waiting
    decode_line: list[_Decode] = field(default_factory=list)  # decode workers waiting


@dataclass
class _Flight:
    """One request between arrival and its end."""

    index: int
    prompt: list[int]
    params: SamplingParams
    pause: float
    decode: _Decode | None = None
    tried: set[str] = field(default_factory=set)
    attempt: int = 0  # its "reserve" events carry this; a later kick makes older ones stale
    ticket: Ticket | None = None  # its place in the router's line while it waits for room


class ClusterSim:
    def __init__(
        self,
        setup,
        admission: str,
        args: EngineArgs,
        label: str = "sim",
        migrate: bool = False,
        skew: str | None = None,
    ) -> None:
        topo = setup.topology
        self.setup, self.label = setup, label
        self.profile = setup.profile
        self.skew = skew
        self.router = RouterConfig(
            max_model_len=args.scheduler_config(setup.config).max_model_len,
            queue_timeout_s=1e9,  # the sweep's routers wait as long as it takes
            migrate_policy="pressure" if migrate else "off",
        )
        self.clock = VirtualClock()
        self.registry = WorkerRegistry(
            self.router, clock=self.clock, connect=lambda r: (None, None)
        )
        blocks = args.num_kv_blocks
        self.decodes = []
        decode_args = dataclasses.replace(args, enable_prefix_caching=args.prefix_offload)
        for k in range(topo.decode):
            eng = sim_engine(
                setup.config, decode_args, setup.cost("decode"), setup.profile, blocks, topo.tp
            )
            name = f"decode-{k}"
            config = DecodeConfig(name, admission=admission)
            self.decodes.append(_Decode(name, eng, DecodeState(eng.core, config, eng.clock)))
        self.prefills = []
        prefill_args = dataclasses.replace(args, preemption="recompute")
        for j in range(topo.prefill):
            eng = sim_engine(
                setup.config, prefill_args, setup.cost("prefill"), setup.profile, blocks, topo.tp
            )
            p = _Prefill(f"prefill-{j}", eng, Batcher(eng.core.token_budget))
            if self.profile.shares_cpus and setup.turn_s > 0:
                p.turns = TurnBudget(setup.turn_s, eng.core.token_budget)
            self.prefills.append(p)
        # the workers take turns at the node's CPUs (one node: launch's cluster)
        self.cpu = _CpuTurns() if self.profile.shares_cpus else None
        self.layerwise = self.profile.kind == "roofline"  # pdserve's --kv-push auto
        self.block_bytes = (
            self.decodes[0].engine.core.kv.cache.nbytes // blocks
        )  # one block, every layer, one device
        self._events: list[tuple] = []
        self._seq = itertools.count()
        self.steps = 0
        self.migrations = SimMigrations(self, self.router) if migrate else None
        self._records: dict[str, Record] = {}
        self._join = None  # scale-out: how the late workers join, once ...
        self._wave_left = 0  # ... this many first-wave requests more have started
        self._ended = None
        # the router's line of requests waiting for decode room, and who holds each place
        self._line = ReserveLine()
        self._waiting: dict[Ticket, str] = {}
        self._flights: dict[str, _Flight] = {}

    def at(self, t: float, kind: str, *payload) -> None:
        self._at(t, kind, *payload)

    def decode_named(self, name: str) -> _Decode:
        return next(d for d in self.decodes if d.name == name)

    def kick(self, now: float, d: _Decode) -> None:
        """Step `d` now unless a step of it runs."""
        if not d.busy:
            self._step_start(now, d)

    def moved(self, now: float, rid: str, d: _Decode, done, generated: int) -> None:
        """A request's KV moved to `d`, which decodes it from now on (or it ended there),
        after `generated` output tokens elsewhere (its first one on `d` is the last of
        those: counted once)."""
        record = self._records[rid]
        record.where = d.name
        record.moved_tokens += generated - 1
        record.migrations += 1
        if done is not None:
            self._finished(now, d, done)
        self.kick(now, d)

    def _client(self, worker_rid: str) -> str:
        return self.migrations.client_id(worker_rid) if self.migrations else worker_rid

    # -- events ---------------------------------------------------------------------------
    def _at(self, t: float, kind: str, *payload) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def _heartbeat(self, now: float = 0.0) -> None:
        for d in self.decodes:
            self.registry.upsert(WorkerRecord(d.name, "decode", d.name, "", d.state.stats()))
        if self._line.closed:
            self._ask_head(now)  # a decode heartbeat kicks the router's line
        for p in self.prefills:
            core = p.engine.core
            stats = WorkerStats(core.free_blocks, core.num_blocks, queued_tokens=p.queued)
            self.registry.upsert(WorkerRecord(p.name, "prefill", p.name, "", stats))

    def run(self, specs: list[RequestSpec], prompts: list[list[int]], concurrency: int | None):
        arrivals = Arrivals(specs, concurrency)
        records: dict[str, Record] = self._records
        flights: dict[str, _Flight] = self._flights
        hs = self.profile.handoff
        self._heartbeat()  # every worker registers
        late = [self.registry.find(d.name, "decode") for d in self.decodes[1:]]
        if self.skew is not None:  # drained until they join
            if self.skew == "scale-out" and concurrency is None:
                raise ValueError("skew: scale-out joins after the first wave of a closed loop")
            for w in late:
                self.registry.drain(w)

        def join() -> None:
            for w in late:  # they join: the next request may go to them
                self.registry.drain(w, undo=True)

        if self.skew == "scale-out":
            self._join, self._wave_left = join, concurrency
        sent = 0
        cap, vocab = self.setup.max_tokens, self.setup.config.vocab_size
        self._at(self.router.heartbeat_s, "heartbeat")
        if self.migrations is not None:
            self._at(self.router.rebalance_period_s, "rebalance")
        bar_args = dict(desc=self.label, unit="req", disable=not self.label, leave=False)
        with progress(total=len(specs), **bar_args) as bar:

            def ended(rid: str, t: float) -> None:
                records[rid].end = t + hs.per_token_s
                flights.pop(rid, None)
                arrivals.ended(t)
                if self.migrations is not None:
                    self.migrations.ended(rid)
                bar.update(1)

            self._ended = ended

            def arrive(now: float) -> None:
                nonlocal sent
                for at, i in arrivals.pop_due(now):
                    sent += 1
                    if self.skew == "late-join" and sent == len(specs) // 2 + 1:
                        join()
                    rid = f"r{i}"
                    spec = specs[i]
                    records[rid] = Record(rid, at, spec.output_tokens)
                    params = request_params(len(prompts[i]), spec.output_tokens, cap, vocab)
                    flights[rid] = _Flight(i, prompts[i], params, self.router.reserve_retry_s[0])
                    self._at(at, "reserve", rid, 0)

            now = 0.0
            arrive(now)
            while self._events or not arrivals.exhausted:
                nxt = arrivals.next_time()
                if nxt is not None and (not self._events or nxt < self._events[0][0]):
                    now = self.clock.now = nxt
                    arrive(now)
                    continue
                now, _, kind, payload = heapq.heappop(self._events)
                self.clock.now = now
                if kind == "heartbeat":
                    self._heartbeat(now)
                    if flights or not arrivals.exhausted:
                        self._at(now + self.router.heartbeat_s, "heartbeat")
                elif kind == "reserve":
                    rid, attempt = payload
                    if rid in flights and flights[rid].attempt == attempt:  # else stale
                        self._reserve(now, rid, flights[rid])
                elif kind == "submit":
                    self._submit(now, *payload)
                elif kind == "prefilled":
                    self._prefilled(now, *payload)
                elif kind == "prefill-turn-end":
                    self._prefill_turn_end(now, *payload)
                elif kind == "start":
                    self._start(now, payload[0], payload[1], flights, records, ended)
                elif kind == "step":
                    self._step_end(now, *payload, records, ended)
                elif kind == "rebalance":
                    self.migrations.rebalancer.tick()
                    if flights or not arrivals.exhausted:
                        self._at(now + self.router.rebalance_period_s, "rebalance")
                elif kind == "migrate-stop":
                    self.migrations.stop(now, *payload)
                elif kind == "migrate-start":
                    self.migrations.start(now, *payload)
                arrive(now)
        return list(records.values())

    # -- the router -----------------------------------------------------------------------
    def _ask_head(self, now: float, kicked: bool = True) -> None:
        """The line's head asks now (a kick: room may be back; its backoff starts over)."""
        head = self._line.head()
        if head is None:
            return
        rid = self._waiting[head]
        flight = self._flights[rid]
        if kicked:
            flight.pause = self.router.reserve_retry_s[0]
        flight.attempt += 1
        self._at(now, "reserve", rid, flight.attempt)

    def _reserve(self, now: float, rid: str, flight: _Flight) -> None:
        if flight.ticket is None:  # it joins at its first try, in arrival order
            flight.ticket = self._line.join()
            self._waiting[flight.ticket] = rid
        if not self._line.may_ask(flight.ticket):
            return  # its turn comes when the ones ahead have reserved
        hs = self.profile.handoff
        tried: set[str] = set()
        # the line per decode worker new requests may go to, as the router sends it
        waiting = waiting_per_worker(len(self._line), len(self.registry.routable("decode")))
        while (worker := self.registry.pick_decode(tried)) is not None:
            tried.add(worker.worker_id)
            d = next(x for x in self.decodes if x.name == worker.worker_id)
            d.engine.clock.now = max(d.engine.clock.now, now)
            try:
                # the simulated router renews the lease until the push is done
                reserved = d.state.reserve(
                    rid, flight.prompt, flight.params, self.router.push_window_s, waiting=waiting
                )
            except ReservationError:
                self.registry.not_reserved(worker)
                continue
            self.registry.reserved(worker, reserved.headroom_cost)
            self._line.leave(flight.ticket)
            del self._waiting[flight.ticket]
            flight.ticket = None
            if self._line.closed:
                self._ask_head(now, kicked=False)  # the next one asks at once
            flight.decode = d
            prefill = self.registry.pick_prefill(len(flight.prompt))
            p = next(x for x in self.prefills if x.name == prefill.worker_id)
            # no pool layout or agent metadata in a simulation: the blocks are what counts
            dest = Destination(d.name, b"", None, reserved.block_ids, reserved.cached_blocks)
            self._at(now + hs.reserve_s + hs.prefill_rpc_s / 2, "submit", p, rid, dest, flight)
            return
        self._line.refused()
        if self._line.head() is not flight.ticket:
            return  # refused while the line was open: it waits its turn now
        flight.attempt += 1
        self._at(now + flight.pause, "reserve", rid, flight.attempt)
        flight.pause = min(self.router.reserve_retry_s[1], flight.pause * 2)

    # -- prefill workers --------------------------------------------------------------------
    def _submit(
        self, now: float, p: _Prefill, rid: str, dest: Destination, flight: _Flight
    ) -> None:
        req = p.engine.core.make_request(flight.prompt, flight.params, request_id=rid)
        p.batcher.put(PrefillJob(req, dest))
        p.queued += len(flight.prompt)
        p.jobs += 1
        if not p.busy:
            self._prefill_batch(now, p)

    def _prefill_batch(self, now: float, p: _Prefill) -> None:
        if not p.jobs:
            return
        if p.turns is not None:
            p.batcher.budget = p.turns.tokens()
        batch = p.batcher.next_batch()
        core = p.engine.core
        runnable = reserve_batch(core, batch, p.batcher)
        p.jobs -= len(runnable)
        p.queued -= sum(j.tokens for j in runnable)
        p.busy = True
        if self.cpu is not None:  # its forward pass waits for its turn
            p.waiting = runnable
            self.cpu.prefill_line.append(p)
            self._next_turns(now)
            return
        self._prefill_compute(now, p, runnable)

    def _prefill_compute(self, now: float, p: _Prefill, runnable: list[PrefillJob]) -> None:
        core = p.engine.core
        if p.turns is not None and len(runnable) == 1:  # a part of a lone prompt per turn
            req = runnable[0].request
            part = p.turns.part(req.num_tokens - req.num_computed_tokens, core.block_size)
            if part:
                computed = core.prefill_part(req, part)
                seconds = p.engine.runner.last_seconds
                p.turns.observe(computed, seconds)
                p.parts += computed
                p.waiting = runnable
                self.cpu.prefill = p
                self._at(now + seconds, "prefill-turn-end", p)  # then it waits again
                return
        tokens = core.prefill([j.request for j in runnable])
        compute = p.engine.runner.last_seconds
        if p.turns is not None:
            p.turns.observe(sum(j.tokens for j in runnable) - p.parts, compute)
            p.parts = 0
        if self.cpu is not None:
            self.cpu.prefill = p
            self._at(now + compute, "prefill-turn-end", None)
        pushed = sum(len(j.dest.block_ids) - j.dest.cached_blocks for j in runnable)
        link = self.profile.link
        total = pushed * self.block_bytes / link.bytes_s
        layers = self.setup.config.num_layers
        tail = link.latency_s + (
            max(total / layers, total - compute * (layers - 1) / layers)
            if self.layerwise
            else total
        )
        self._at(now + compute + tail, "prefilled", p, runnable, tokens)

    def _prefilled(
        self, now: float, p: _Prefill, jobs: list[PrefillJob], tokens: list[int]
    ) -> None:
        hs = self.profile.handoff
        for job, token in zip(jobs, tokens):
            p.engine.core.release(job.request)
            self._at(
                now + hs.prefill_rpc_s / 2 + hs.start_s, "start", job.request.request_id, token
            )
        p.busy = False
        self._prefill_batch(now, p)

    # -- decode workers ---------------------------------------------------------------------
    def _start(self, now, rid, token, flights, records, ended) -> None:
        d = flights[rid].decode
        d.engine.clock.now = max(d.engine.clock.now, now)
        records[rid].first = now + self.profile.handoff.per_token_s
        records[rid].where = d.name
        if self._join is not None:  # scale-out: the late ones join once the wave streams
            self._wave_left -= 1
            if self._wave_left == 0:
                self._join()
                self._join = None
        res, done = d.state.start(rid, token)
        if self.migrations is not None and done is None:
            flight = flights[rid]
            self.migrations.streaming(rid, d, res.request, flight.prompt, flight.params.max_tokens)
        if done is not None:
            d.state.observe(done)
            records[rid].output_tokens = len(done.output_token_ids)
            ended(rid, now)
        if not d.busy:
            self._step_start(now, d)

    def _step_start(self, now: float, d: _Decode) -> None:
        eng = d.engine
        eng.clock.now = max(eng.clock.now, now)
        d.state.expire()
        plan = eng.core.begin_step()
        if plan is None:
            return
        d.busy = True
        cpu = self.cpu
        if cpu is not None and (cpu.prefill is not None or cpu.prefill_line):
            d.waiting = plan  # a prefill batch holds the CPUs, or waits at the gate
            cpu.decode_line.append(d)
            return
        self._step_run(now, d, plan)

    def _step_run(self, now: float, d: _Decode, plan: StepPlan) -> None:
        eng = d.engine
        eng.clock.now = max(eng.clock.now, now)
        result = eng.core.run(plan)
        if self.cpu is not None:
            self.cpu.decoding += 1
        self._at(now + eng.runner.last_seconds, "step", d, plan, result, now)

    def _prefill_turn_end(self, now: float, again: _Prefill | None) -> None:
        """A prefill pass's turn ends; `again`: its worker has a part of its prompt left and
        waits for another turn, after the decode workers that waited for this one."""
        self.cpu.prefill = None
        if again is not None:
            self.cpu.prefill_line.append(again)
        self._next_turns(now, handover=True)

    def _next_turns(self, now: float, handover: bool = False) -> None:
        """Whoever's turn it is at the shared CPUs starts. `handover`: a prefill batch's
        turn just ended, and the decode workers that waited for it step first (side by
        side); otherwise a waiting prefill batch goes once no decode step runs, and decode
        steps wait behind it (the gate)."""
        cpu = self.cpu
        if cpu.prefill is not None:
            return
        if cpu.decode_line and (handover or not cpu.prefill_line):
            line, cpu.decode_line = cpu.decode_line, []
            for d in line:
                plan, d.waiting = d.waiting, None
                self._step_run(now, d, plan)
            return
        if cpu.prefill_line and cpu.decoding == 0:
            p = cpu.prefill_line.popleft()
            runnable, p.waiting = p.waiting, None
            self._prefill_compute(now, p, runnable)

    def _step_end(
        self,
        now: float,
        d: _Decode,
        plan: StepPlan,
        result: RunResult,
        began: float,
        records,
        ended,
    ) -> None:
        eng = d.engine
        eng.clock.now = now
        if self.cpu is not None:
            self.cpu.decoding -= 1
        out = eng.core.end_step(plan, result)
        d.state.observe_step(plan, now - began)
        self.steps += 1
        for done in out.finished:
            self._finished(now, d, done)
        pool = eng.core.stats().pool
        bw = 0.0
        if self.profile.memory_bytes_s and now > began:
            bw = eng.runner.last_bytes / (now - began) / self.profile.memory_bytes_s
        d.series.add(now, pool.used_blocks / pool.num_blocks, bw)
        d.busy = False
        if self.migrations is not None:
            self.migrations.step_boundary(now, d)
        self._step_start(now, d)
        if self.cpu is not None:
            self._next_turns(now)

    def _finished(self, now: float, d: _Decode, done) -> None:
        d.state.observe(done)
        rid = self._client(done.request_id)
        r = self._records[rid]
        r.output_tokens = len(done.output_token_ids) + r.moved_tokens
        r.preemptions += done.metrics.preemptions
        r.recomputed_tokens += done.metrics.recomputed_tokens
        self._ended(rid, now)
        if self._line.closed:
            self._ask_head(now)  # its blocks are free: the router's final message kicks


def run_cluster(
    setup, admission, args, specs, prompts, concurrency, label, migrate=False, skew=None
):
    """-> (records, decode steps, every engine, per decode worker's series, moves)."""
    sim = ClusterSim(setup, admission, args, label, migrate, skew)
    records = sim.run(specs, prompts, concurrency)
    engines = [d.engine for d in sim.decodes] + [p.engine for p in sim.prefills]
    for d in sim.decodes:
        d.state.check_integrity()
    cpu = sim.cpu
    if cpu is not None and (cpu.prefill or cpu.decoding or cpu.prefill_line or cpu.decode_line):
        raise AssertionError(f"the simulated CPU turns did not all end: {cpu}")
    series = {d.name: d.series.points for d in sim.decodes}
    moves = sim.migrations.moves if sim.migrations is not None else 0
    return records, sim.steps, engines, series, moves
