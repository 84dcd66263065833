"""Admission policies: may a new request's KV join this decode worker's pool now?

`greedy` (the baseline, as vLLM v1 and SGLang do): admit while the prompt's blocks are free
now and no preempted request waits for room (first come, first served; kv-aware too). A
worker holding nothing admits whatever fits, whatever the policy. `kv-aware`: admit only
while the projected demand fits,

    sum over held requests of blocks(len_r + E_rem(g_r, M_r))
      + blocks(prompt + E_rem(0, M_new))  <=  (1 - margin) * pool blocks

and the prompt's blocks are free now; held requests are the running, reserved and parked
(spilled) ones, len_r the tokens whose KV they hold or will hold, g_r their generated tokens
and M_r their max_tokens; E_rem is the online estimate of pdserve/engine/length_estimator.py.
A block several requests share (a cached prefix, with prefix caching on) counts once: each
request's term leaves out the blocks already counted for an earlier one, and the new
request's leaves out the held blocks its prompt would share.
A request refused here waits (its TTFT grows) instead of being preempted later.

`cost-aware` (the default) admits by the peak of the expected demand instead of its sum, and
keeps room for the demand's spread above that peak in the pool or, where parking is cheap on
this deployment (pdserve/engine/costs.py measures it), in the tiers:

    admit when  the prompt's blocks are free now,
                no preempted request waits for room (first come, first served), and
                D_peak  <=  (1 - margin) * pool blocks + R

    R = min(0, ROOM - min(Z * D_sd, D_worst - D_peak))       (a line of requests waits)
    R = ROOM - min(Z * D_sd, D_worst - D_peak)               (at most one per worker waits)
                          ROOM = the tier blocks that fit the parking-time budget
                          PARK_OVERHEAD * L * step_s, tiers filled in order, each block of
                          tier t costing park_s(t); D_worst = every request at its cap

D_peak is the most blocks the held requests (the new one included) are expected to hold at
once over the coming steps, each alive with the probability the observed lengths give for
its age (pdserve/engine/peak_demand.py): kv-aware's sum has every request at its expected
end at the same time, which in a steady state is about twice what the pool ever holds
(simulated H200 reasoning runs: kv-aware kept the pool 66% full), so admitting by the peak
commits the pool past every held request's expected final size. D_sd is the standard
deviation of the demand at that peak, in blocks. L is the mean observed output length (the
steps a request lives), step_s a decode step's time and park_s(t) a block's spill + reload
time in tier t. The reasoning: when the demand runs Z standard deviations above its
expected peak, about that many blocks' worth of requests sit in the tiers and each moves
out and back about once a request lifetime, so parking takes about sum_t ROOM_t *
park_s(t) / L seconds per step; ROOM is the most blocks the tiers have free that keeps this
under PARK_OVERHEAD of a step. Where the tiers cannot hold the spread, the rest of it is
kept inside the pool (R < 0); when parking is impossible (recompute preemption, no tiers,
tiers full) or slower than computing the block again, ROOM = 0 and the policy admits only
while the expected peak plus Z sd fits the pool. While a line waits, nothing is admitted
past the expected peak itself (R is at most 0): a request admitted there is expected to wait
in a tier, and its wait is its TPOT. Until 2026-12-07 R was ROOM less the spread, often hundreds of
blocks past the peak; simulated on this CPU's profile (seven layouts and loads, 8 seeds
each: scripts/sim_past_peak.py) that changed throughput by -2% to +4% for a TPOT p99 of 0.31-0.83
greedy+recompute's where this rule gives 0.21-0.80 (medians; docs/capacity-trap.md, "No
admission past the expected peak"). That holds while a line of requests waits for room:
each block the pool has free below its peak is soon taken by one of them, so admitting past
the peak only moves a request's wait from the router into a tier. With no line (at most one
request waiting per decode worker, this one included: `waiting`, which the router sends
with each Reserve and the colocated engine counts in its own queue) a request refused is a
request whose wait leaves the pool short of its peak for a whole request lifetime: there the
policy admits past the peak by what the tiers hold (R = ROOM less the spread, as before
2026-12-07, but floored where that truncated toward 0: at most a block). Simulated on the
same profile, the demo's 4 clients' worst seed went from 0.86x to 0.95x the better greedy's
throughput and from 1.40x to 1.27x its e2e p50, the knee unchanged (docs/capacity-trap.md,
"past the peak again, where no line waits"; real runs there). Where the
line is not known (a migration's Reserve, an older router), the peak rule holds. A worker
holding nothing admits whatever fits (else a request alone, whose cap fits, could be
refused for its spread forever).
The tail is kept short by rotation, which this policy installs in the scheduler when it
parks victims (pdserve/engine/scheduler.py, Scheduler._rotate): a parked request whose
slowdown (steps per generated token, its stalls counted) reaches twice a running one's
takes that one's turn, so no request's TPOT is left to grow while shorter-stalled ones run.
A runner leaves only after it has run `rotation_steps_per_block()` steps per block it holds:
then the extra round trip through the tier costs at most PARK_OVERHEAD of the steps it ran.

Every policy answers in one unit, blocks of headroom: `headroom(held)` is what a new
request could still count on (what the router routes on) and `cost(prompt, max_tokens)` is
how much of it one admitted request takes (what the router subtracts until the next
heartbeat).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Protocol

from pdserve.engine.costs import PreemptionCosts
from pdserve.engine.length_estimator import OutputLengthEstimator
from pdserve.engine.output import HeldRequest
from pdserve.engine.peak_demand import PeakDemand, peak_demand
from pdserve.registry import Registry


class PoolView(Protocol):
    """What admission reads of the engine core's pool (EngineCore provides it)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...

    def blocks_needed(self, num_tokens: int) -> int: ...

    def can_reserve(self, token_ids: list[int]) -> bool: ...

    def shared_blocks(self, token_ids: list[int]) -> list[int]: ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_shared_blocks(self) -> int: ...

    @property
    def parks_victims(self) -> bool: ...

    def longest_preempted_wait(self) -> int: ...

    def preempted_waiting(self) -> bool: ...

    def tier_stats(self) -> dict[str, dict]: ...


@dataclass(frozen=True)
class PolicyInputs:
    """What the cost-aware policy decided from, at its last look (exported as gauges)."""

    step_s: float | None = None
    recompute_s_per_token: float | None = None
    park_s_per_block: dict[str, float | None] = field(default_factory=dict)
    tier_free_blocks: int = 0
    overcommit_blocks: int = 0  # R
    demand_blocks: int = 0  # D_peak of the held requests
    demand_sd_blocks: float = 0.0
    rotation_steps_per_block: float = 0.0  # how long a request runs before it can rotate out
    longest_stall_steps: int = 0


def waiting_per_worker(line: int, workers: int) -> float | None:
    """What check()'s `waiting` is: the requests in a line for decode room (the one asked
    about included) per decode worker that may take them; None when either is not known (0:
    a migration's Reserve, an older router)."""
    return line / workers if line > 0 and workers > 0 else None


def may_share(pool: PoolView, held: Sequence[HeldRequest]) -> bool:
    """Whether two of `held` can list a block in common. Only a block with two owners is in
    two owners' tables, so while the pool has none, only a request not admitted yet (its
    prompt's prefix hits) can: otherwise the shared-block bookkeeping, a set over every
    block held (hundreds of thousands at GPU scale, per check), is skipped."""
    return pool.num_shared_blocks > 0 or any(h.block_ids and not h.owns for h in held)


def counted_before(pool: PoolView, held: Sequence[HeldRequest]) -> Iterator[int]:
    """For each held request in order, how many of its blocks an earlier one lists (so that
    a block they share counts once); all 0 when none can share (may_share)."""
    if not may_share(pool, held):
        yield from repeat(0, len(held))
        return
    seen: set[int] = set()
    for h in held:
        yield len(seen.intersection(h.block_ids))
        seen.update(h.block_ids)


def projected_blocks(
    pool: PoolView, estimator: OutputLengthEstimator, held: Sequence[HeldRequest]
) -> int:
    """Blocks the held requests will hold once each has grown by the output `estimator`
    expects of it (blocks they share counted once)."""
    return sum(
        pool.blocks_needed(h.tokens + round(estimator.remaining(h.generated, h.max_tokens)))
        - counted
        for h, counted in zip(held, counted_before(pool, held))
    )


class GreedyAdmission:
    """Admit whenever the prompt's blocks are free now."""

    inputs: PolicyInputs | None = None  # what the policy decided from (cost-aware only)

    def __init__(
        self,
        pool: PoolView,
        estimator: OutputLengthEstimator,
        margin: float,
        costs: PreemptionCosts | None = None,
    ) -> None:
        self.pool = pool
        self.estimator = estimator
        self.margin = margin
        self.costs = costs or PreemptionCosts()  # what cost-aware reads; measured by the worker

    def headroom(self, held: Sequence[HeldRequest]) -> int:
        # nothing new gets in while a preempted request waits: no room to route to
        return 0 if self.pool.preempted_waiting() else self.pool.free_blocks

    def cost(self, prompt: list[int], max_tokens: int, generated: int = 0) -> int:
        return self.pool.blocks_needed(len(prompt)) - len(self.pool.shared_blocks(prompt))

    def rotation(self) -> Callable[[], float] | None:
        """What the scheduler rotates parked requests by (Scheduler.rotation), or None: each
        preempted request waits for room, the victim the most recently admitted."""
        return None

    def check(
        self,
        prompt: list[int],
        max_tokens: int,
        held: Sequence[HeldRequest],
        waiting: float | None = None,
        generated: int = 0,
    ) -> str | None:
        """None when the request may be admitted, else why not; `waiting`: requests waiting
        for room per decode worker, this one included (None: not known; only cost-aware
        reads it); `generated`: tokens it generated elsewhere (a migration's: the prompt
        ends with them, and max_tokens counts them). First come, first served,
        as vLLM's and SGLang's schedulers do: while a preempted request waits for room, a
        new one waits behind it (a decode worker's Reserve takes blocks directly, so
        without this a new request took the blocks a preempted one was waiting for)."""
        if self.pool.preempted_waiting():
            return "a preempted request is waiting for room (first come, first served)"
        return self.prompt_fits(prompt)

    def prompt_fits(self, prompt: list[int]) -> str | None:
        """None when the prompt's blocks are free now, else why not."""
        pool = self.pool
        if not pool.can_reserve(prompt):
            return f"{pool.blocks_needed(len(prompt))} KV blocks needed, {pool.free_blocks} free"
        return None


class KVAwareAdmission(GreedyAdmission):
    """Admit while every held request's expected growth still fits."""

    @property
    def budget(self) -> int:
        return int((1 - self.margin) * self.pool.num_blocks)

    def projected_blocks(self, held: Sequence[HeldRequest]) -> int:
        return projected_blocks(self.pool, self.estimator, held)

    def headroom(self, held: Sequence[HeldRequest]) -> int:
        return self.budget - self.projected_blocks(held)

    def _new(self, prompt: list[int], max_tokens: int, generated: int = 0) -> HeldRequest:
        hits = tuple(self.pool.shared_blocks(prompt))
        return HeldRequest("", len(prompt), generated, max_tokens, hits, owns=False)

    def cost(self, prompt: list[int], max_tokens: int, generated: int = 0) -> int:
        new = self._new(prompt, max_tokens, generated)
        return self.projected_blocks([new]) - len(new.block_ids)

    def check(
        self,
        prompt: list[int],
        max_tokens: int,
        held: Sequence[HeldRequest],
        waiting: float | None = None,
        generated: int = 0,
    ) -> str | None:
        refused = super().check(prompt, max_tokens, held)
        if refused is not None or not held:  # a worker holding nothing takes what fits
            return refused
        demand = self.projected_blocks([*held, self._new(prompt, max_tokens, generated)])
        if demand > self.budget:
            return f"projected KV demand {demand} blocks exceeds {self.budget} (kv-aware admission)"
        return None


class CostAwareAdmission(KVAwareAdmission):
    """Admission by the expected peak of the demand, its spread kept in the tiers where
    parking is cheap here, else in the pool (the formula above)."""

    PARK_OVERHEAD = 0.05  # parking may take this fraction of decode time
    Z = 1.0  # the tail the tiers must hold: demand this many standard deviations up
    # the rule until 2026-12-07: R = ROOM - the tail, admitting past the expected peak by what
    # the tiers hold; kept for scripts/sim_past_peak.py, which compares the two
    PAST_PEAK = False
    # requests waiting per decode worker (the candidate included) up to which the policy
    # admits past the expected peak: no line, so room refused would stay unused
    NO_LINE = 1.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.inputs = PolicyInputs()

    def _lifetime(self, max_tokens: int) -> float:
        """Steps a typical request lives: the mean observed length, or this one's cap."""
        mean = self.estimator.mean_length()
        return mean if mean is not None else float(max_tokens)

    def _demand(self, held: Sequence[HeldRequest]) -> tuple[int, float, PeakDemand]:
        """(D_peak, the tail to keep room for: Z * D_sd but never past the worst case, the
        peak's figures), in blocks (pdserve/engine/peak_demand.py); shared blocks count
        once, as in projected_blocks()."""
        counted = list(counted_before(self.pool, held))
        peak = peak_demand(held, counted, self.estimator, self.pool.block_size)
        demand = math.ceil(peak.blocks)
        # every request at its cap at once is the most the demand can be: a request that
        # fits the pool at its cap is never refused for its spread
        return demand, min(self.Z * peak.sd_blocks, max(0, peak.worst_blocks - demand)), peak

    def _tiers(self) -> tuple[dict[str, float | None], dict[str, int]]:
        """(park_s per tier, free blocks per tier), in the order parks fill the tiers."""
        tiers = self.pool.tier_stats()
        park_s = {name: self.costs.park_s_per_block(t) for name, t in tiers.items()}
        free = {name: max(0, t["capacity"] - t["used_blocks"]) for name, t in tiers.items()}
        return park_s, free

    def _room(self, lifetime: float) -> tuple[float, dict[str, float | None], dict[str, int]]:
        """(ROOM, park_s per tier, free blocks per tier). The tiers are filled in the order
        parks use them, each while the parking-time budget (PARK_OVERHEAD * L * step_s)
        lasts; a tier that has not moved a block yet costs nothing until it has, one slower
        than recomputing the block ends the walk."""
        costs = self.costs
        park_s, free = self._tiers()
        if not self.pool.parks_victims:
            return 0.0, park_s, free
        budget_s = (
            float("inf") if costs.step_s is None else self.PARK_OVERHEAD * lifetime * costs.step_s
        )
        recompute_block = (
            None
            if costs.recompute_s_per_token is None
            else costs.recompute_s_per_token * self.pool.block_size
        )
        room = 0.0
        for name, c in park_s.items():
            if c is not None and recompute_block is not None and c >= recompute_block:
                break  # slower than computing the block again: it holds none of the spread
            take = free[name] if not c else min(free[name], budget_s / c)
            room += take
            budget_s -= take * (c or 0.0)
        return room, park_s, free

    def _limit(
        self, held: Sequence[HeldRequest], max_tokens: int, past_peak: bool = False
    ) -> tuple[int, int]:
        """(D_peak of `held`, the most it may reach: budget + R, R past the peak by what
        the tiers hold when `past_peak`); records the inputs."""
        lifetime = self._lifetime(max_tokens)
        demand, tail, peak = self._demand(held)
        room, park_s, free = self._room(lifetime)
        # below 0: the tiers cannot hold the tail, keep it in the pool; above 0 only with no
        # line (`past_peak`): while a line waits, a request admitted past the expected peak
        # is expected to wait parked (its TPOT) for room someone in the line would have used
        past = past_peak or self.PAST_PEAK
        r = math.floor(room - tail) if past else min(0, math.floor(room - tail))
        self.inputs = PolicyInputs(
            step_s=self.costs.step_s,
            recompute_s_per_token=self.costs.recompute_s_per_token,
            park_s_per_block=park_s,
            tier_free_blocks=sum(free.values()),
            overcommit_blocks=r,
            demand_blocks=demand,
            demand_sd_blocks=peak.sd_blocks,
            rotation_steps_per_block=self._steps_per_block(park_s, free),
            longest_stall_steps=self.pool.longest_preempted_wait(),
        )
        return demand, self.budget + r

    def headroom(self, held: Sequence[HeldRequest]) -> int:
        # the inputs are recorded (the gauges) whether or not anything may get in
        demand, limit = self._limit(held, max((h.max_tokens for h in held), default=1))
        if self.pool.preempted_waiting():
            return 0  # nothing new gets in while a preempted request waits
        return limit - demand

    def rotation(self) -> Callable[[], float] | None:
        return self.rotation_steps_per_block if self.pool.parks_victims else None

    def rotation_steps_per_block(self) -> float:
        """Steps a running request runs, per block it holds, before a parked request may
        take its turn (the scheduler's rotation): then the extra round trip through the
        tier it would park in costs at most PARK_OVERHEAD of the steps it ran. 0 until the
        tier has moved a block both ways and a decode step was timed."""
        return self._steps_per_block(*self._tiers())

    def _steps_per_block(self, park_s: dict[str, float | None], free: dict[str, int]) -> float:
        step_s = self.costs.step_s
        tier = next((name for name, room in free.items() if room), None)  # where parks go next
        if not step_s or tier is None or park_s[tier] is None:
            return 0.0
        return park_s[tier] / (self.PARK_OVERHEAD * step_s)

    def check(
        self,
        prompt: list[int],
        max_tokens: int,
        held: Sequence[HeldRequest],
        waiting: float | None = None,
        generated: int = 0,
    ) -> str | None:
        refused = GreedyAdmission.check(self, prompt, max_tokens, held)  # first come, first served
        if refused is not None:
            return refused
        if not held:  # a worker holding nothing takes what fits (else it could wait forever)
            return None
        # one pass over everyone held, the new request included (its spread counts too)
        no_line = waiting is not None and waiting <= self.NO_LINE
        new = self._new(prompt, max_tokens, generated)
        demand, limit = self._limit([*held, new], max_tokens, no_line)
        if demand > limit:
            return f"projected KV demand {demand} blocks exceeds {limit} (cost-aware admission)"
        return None


# what a decode worker and the colocated LLM admit by given no flags
DEFAULT_ADMISSION = "cost-aware"
DEFAULT_MARGIN = 0.05  # kv-aware keeps this fraction of the pool free
ADMISSION: Registry[type[GreedyAdmission]] = Registry(
    "admission",
    {"greedy": GreedyAdmission, "kv-aware": KVAwareAdmission, "cost-aware": CostAwareAdmission},
)


def check_admission(policy: str, margin: float) -> None:
    """ValueError naming the setting when either is not one a policy can run with."""
    ADMISSION.check(policy)
    if not 0 <= margin < 1:
        raise ValueError(f"admission_margin: must be in [0, 1), got {margin}")
