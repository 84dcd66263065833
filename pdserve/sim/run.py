"""Running the simulator: one point (a policy at a concurrency) on a topology, and a sweep of
points, reported as `bench sweep` reports real runs (the same fields, plus what only a
simulator can show: KV usage and memory-bandwidth utilisation over time, steps/s).

    Topology(dp=8, tp=1)                       colocated replicas (data parallel)
    Topology(tp=8, dp_attention=True)          one TP=8 replica, attention data-parallel
    Topology(prefill=1, decode=2)              disaggregated (pdserve/sim/cluster.py)
    point = simulate(setup, "kv-aware+tiered", specs, concurrency=64)
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pdserve.bench.slo import SLO
from pdserve.bench.sweep import parse_policy, split_migrate
from pdserve.bench.workload import RequestSpec, prompts_for
from pdserve.config import ModelConfig
from pdserve.engine.args import EngineArgs
from pdserve.engine.gate import make_admission
from pdserve.sim.cost import CostModel, FittedCost, RooflineCost
from pdserve.sim.engine import kv_blocks, sim_engine
from pdserve.sim.load import summarize
from pdserve.sim.profile import Profile
from pdserve.sim.replica import ROUTES, Replica, run_sim
from pdserve.sim.runner import over_cap
from pdserve.sim.shape import ModelShape
from prefill.config import PrefillConfig


@dataclass(frozen=True)
class Topology:
    dp: int = 1  # colocated replicas (ignored when prefill/decode are set)
    tp: int = 1  # GPUs per replica (or per worker) sharing its weights and KV heads
    prefill: int = 0  # disaggregated: prefill workers ...
    decode: int = 0  # ... and decode workers
    route: str = "headroom"  # how requests pick a colocated replica (or attention rank)
    # each replica's TP ranks attend data-parallel, each for its own requests with their
    # whole KV, the MLP split over the group (pdserve/sim/shape.py): simulated as tp
    # attention ranks per replica, each its own scheduler and pool, requests routed to them
    dp_attention: bool = False
    # dp_attention: how many of a replica's tp attention ranks to simulate (None: all); the
    # others are taken to carry the same load, as a rank's cost already assumes (a study
    # at 1/tp of the clients on one rank runs tp times faster)
    attention_ranks: int | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if (self.prefill > 0) != (self.decode > 0):
            raise ValueError("prefill/decode: give both for a disaggregated topology, or neither")
        if self.dp_attention and self.tp < 2:
            raise ValueError("dp_attention: needs tensor parallelism (tp >= 2) to split")
        if self.dp_attention and self.decode > 0:
            raise ValueError("dp_attention: simulated for colocated replicas only, not 1PnD")
        if self.attention_ranks is not None and not (
            self.dp_attention and 1 <= self.attention_ranks <= self.tp
        ):
            raise ValueError(
                f"attention_ranks: 1 to tp ({self.tp}) with dp_attention, "
                f"got {self.attention_ranks}"
            )
        if self.route not in ROUTES:
            raise ValueError(f"route: {self.route!r}; choose one of {', '.join(ROUTES)}")

    @property
    def disaggregated(self) -> bool:
        return self.decode > 0

    @property
    def gpus(self) -> int:
        workers = self.prefill + self.decode if self.disaggregated else self.dp
        return workers * self.tp

    @property
    def engines(self) -> int:
        """Schedulers of a colocated topology: a replica's, or each attention rank's."""
        if not self.dp_attention:
            return self.dp
        return self.dp * (self.attention_ranks or self.tp)

    def describe(self) -> str:
        if self.disaggregated:
            return f"{self.prefill}P{self.decode}D, TP={self.tp}"
        if not self.dp_attention:
            return f"DP={self.dp}, TP={self.tp}"
        ranks = self.attention_ranks
        some = (
            f" ({ranks} of its {self.tp} ranks simulated)" if ranks not in (None, self.tp) else ""
        )
        return f"DP={self.dp}, TP={self.tp}, DP attention{some}"


# the terms of a fitted step cost that only a step carrying a prefill chunk pays
# (pdserve/sim/cost.py FEATURES)
RECOMPUTE_TERMS = ("prefill_tokens", "prefill_attention", "prefill_seqs", "prefill_step")


@dataclass(frozen=True)
class Setup:
    """Everything a simulated run needs besides its policy and load."""

    config: ModelConfig
    profile: Profile
    topology: Topology
    args: EngineArgs  # block size, pool (num_kv_blocks; None: what the profile's memory holds)
    weight_dtype_bytes: float = 2
    slo: SLO = SLO()
    seed: int = 0
    skew: str | None = None  # "late-join": decode workers but the first join midway
    # with a profile whose workers share the CPUs: a prefill batch's turn (prefill/turns.py;
    # `serve prefill --turn-s`, 0: batches by tokens alone)
    turn_s: float = PrefillConfig.turn_s
    # every request's max_tokens, its length hidden until it samples its stop token
    # (pdserve/sim/runner.py); None: its length is its max_tokens, as the benchmarks send it
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.topology.dp_attention and self.profile.kind != "roofline":
            raise ValueError(
                f"dp_attention: profile {self.profile.name} is {self.profile.kind}; "
                "DP attention is costed from a roofline profile (h100, h200)"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.turn_s) and self.turn_s >= 0):
            raise ValueError(
                f"turn_s: must be a finite number >= 0 (0: no bound), got {self.turn_s}"
            )

    def shape(self) -> ModelShape:
        kv = 4 if self.profile.dtype == "float32" else (1 if self.profile.dtype == "fp8" else 2)
        topo = self.topology
        return ModelShape.of(self.config, self.weight_dtype_bytes, kv, topo.tp, topo.dp_attention)

    def cost(self, role: str = "engine") -> CostModel:
        """A role's step cost. A fitted profile's decode steps were measured without a
        prefill in them (pdserve/sim/calibrate_cluster.py), but a decode worker computes a
        recompute preemption's context itself, in its steps: those chunks cost what the
        in-process engine's steps pay for a prefill (its RECOMPUTE_TERMS; the same core and
        runner), on top of the decode step's own terms, times the decode worker's
        intercept over the engine's (how much slower its fixed step cost runs: a 1P2D decode
        worker on 2 CPUs has one thread against the engine's two, 71 against 47 ms on the
        2026-12-05 profile, and --rescale's factor scales it with the decode steps). Before
        2026-12-06 they cost only a sequence's share."""
        p = self.profile
        if p.kind == "fitted":
            decode = p.cluster_decode(self.topology.decode)
            if decode:
                fixed, engine_fixed = decode.get("intercept", 0.0), p.engine.get("intercept", 0.0)
                slower = fixed / engine_fixed if fixed > 0 and engine_fixed > 0 else 1.0
                recompute = {k: v * slower for k, v in p.engine.items() if k in RECOMPUTE_TERMS}
                decode = {**recompute, **decode}
            fitted = {"engine": p.engine, "decode": decode, "prefill": p.cluster_prefill}
            if role not in fitted:
                raise ValueError(f"cost role: {role!r}; choose one of {', '.join(fitted)}")
            return FittedCost(fitted[role] or p.engine)
        return RooflineCost(p, self.shape(), fp8_weights=self.weight_dtype_bytes == 1)

    def num_blocks(self) -> int:
        if self.args.num_kv_blocks is not None:
            return self.args.num_kv_blocks
        if self.profile.kind != "roofline":
            raise ValueError("num_kv_blocks: a fitted profile needs the pool size given")
        return kv_blocks(self.profile, self.shape(), self.args.block_size)


def policy_args(args: EngineArgs, policy: str) -> tuple[str, EngineArgs]:
    admission, preemption = parse_policy(policy)
    return admission, dataclasses.replace(args, preemption=preemption)


def migration_of(setup: Setup, policy: str) -> bool:
    """Whether the policy moves requests between decode workers (`+migrate`): a
    disaggregated topology's router does; colocated replicas have none."""
    migrate = split_migrate(policy)[1]
    if migrate and not setup.topology.disaggregated:
        raise ValueError(f"policy: {policy} needs decode workers (a 1P2D topology, say)")
    return migrate


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a simulated run. A full collection
    traverses every token id of every request alive (millions in a big run: ~110 ms each,
    22 of them in a 4-replica, 2,500-client run, a third of its time); a run makes no
    reference cycles worth collecting before it ends (peak RSS measured the same with
    and without), and the collector is back on, with whatever it finds, afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def check_lengths(setup: Setup, specs: list[RequestSpec]) -> None:
    """With a cap (Setup.max_tokens): every request must fit under it and its prompt plus the
    cap within max_model_len, as a server would refuse it. ValueError naming the field,
    before anything runs."""
    cap = setup.max_tokens
    if cap is None or not specs:
        return
    longest = max(s.output_tokens for s in specs)
    if longest > cap:
        raise over_cap(longest, cap)
    limit = setup.args.scheduler_config(setup.config).max_model_len
    prompt = max(s.prompt_tokens for s in specs)
    if prompt + cap > limit:
        raise ValueError(
            f"max_tokens: the longest prompt ({prompt} tokens) plus the cap {cap} exceeds "
            f"max_model_len {limit}"
        )


def simulate(
    setup: Setup,
    policy: str,
    specs: list[RequestSpec],
    concurrency: int | None,
    label: str = "sim",
) -> dict:
    """One point: the policy under this load on the setup's topology -> its figures."""
    check_lengths(setup, specs)
    admission, args = policy_args(setup.args, policy)
    migrate = migration_of(setup, policy)
    blocks = setup.num_blocks()
    args = dataclasses.replace(args, num_kv_blocks=blocks)
    prompts = prompts_for(specs, setup.config.vocab_size, setup.seed)
    started = time.perf_counter()
    with collector_paused():
        topo = setup.topology
        if topo.disaggregated:
            from pdserve.sim.cluster import run_cluster

            records, steps, engines, series, moves = run_cluster(
                setup, admission, args, specs, prompts, concurrency, label, migrate, setup.skew
            )
        else:
            replicas = []
            ranks = topo.engines // topo.dp  # attention ranks simulated per replica
            for k in range(topo.engines):
                eng = sim_engine(
                    setup.config,
                    args,
                    setup.cost(),
                    setup.profile,
                    blocks,
                    tp=topo.tp,
                    dp_attention=topo.dp_attention,
                )
                name = f"replica-{k // ranks}.{k % ranks}" if topo.dp_attention else f"replica-{k}"
                replicas.append((Replica(name, eng.core, make_admission(admission, eng.core)), eng))
            records, steps = run_sim(
                replicas,
                specs,
                prompts,
                concurrency,
                route=topo.route,
                bandwidth_bytes_s=setup.profile.memory_bytes_s,
                label=label,
                max_tokens=setup.max_tokens,
            )
            engines = [eng for _, eng in replicas]
            moves = 0
            series = {rep.name: rep.series.points for rep, _ in replicas}
    wall = time.perf_counter() - started
    point = summarize(records, setup.slo, concurrency)
    stats = [e.core.stats() for e in engines]
    point.update(
        policy=policy,
        concurrency=concurrency,
        simulated=True,
        steps=steps,
        wall_s=wall,
        sim_steps_per_s=steps / wall if wall else 0.0,
        num_kv_blocks=blocks,
        preemptions=sum(s.preemptions for s in stats),
        rotations=sum(s.rotations for s in stats),
        recomputed_tokens=sum(s.recomputed_tokens for s in stats),
        migrations=moves,
        spilled_bytes=sum(s.spilled_bytes for s in stats),
        reloaded_bytes=sum(s.reloaded_bytes for s in stats),
        per_worker={  # engines lead with the workers that have a series, in order
            rep: {
                "requests": sum(1 for r in records if r.where == rep),
                "preemptions": st.preemptions,
                "recomputed_tokens": st.recomputed_tokens,
            }
            for rep, st in zip(series, stats)
        },
        series=series,
    )
    for e in engines:
        e.core.check_integrity()
    return point
