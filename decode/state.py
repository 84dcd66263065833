"""A decode worker's books, with no threads and no sockets: its engine core, admission
policy, output-length estimator and reservations.

    reserve(id, prompt, params, lease_s, push_window_s) -> Reserved   blocks, if admitted
    renew(id, fence, lease_s) -> bool                    the router keeps a lease alive
    note_arrivals(notes)                                 push notifications (fenced)
    start(id, first_token) -> (Reservation, output|None) the KV is in: decode from here
    start_here(id) -> Reservation                        no KV is coming: prefill it here
    release(id) -> (found, output|None)                  abort, whatever state it is in
    expire()                                             leases that ran out, fences whose
                                                         push is over: blocks come back
    stats() -> WorkerStats                               what a heartbeat carries

DecodeWorker (decode/worker.py) wraps it with a lock, the step loop, the transfer agent and
token streams; the simulator (pdserve/sim) drives the same books on a virtual clock, so a
simulated decode worker admits, refuses and reserves exactly as a real one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from decode.config import DecodeConfig, max_requests
from decode.reservations import Reservation, Reservations
from pdserve.engine.admission import ADMISSION, projected_blocks
from pdserve.engine.core import EngineCore, StepPlan
from pdserve.engine.costs import PreemptionCosts
from pdserve.engine.length_estimator import OutputLengthEstimator
from pdserve.engine.output import FinishedRequest, HeldRequest
from pdserve.sampling_params import SamplingParams
from pdserve.serving.registration import MAX_PARKED_IDS, WorkerStats


class ReservationError(RuntimeError):
    """No room for the request now (RESOURCE_EXHAUSTED at the edge; a retry may help)."""


class UnknownRequest(KeyError):
    """No reservation of that id (expired or released): NOT_FOUND at the edge."""


@dataclass(frozen=True)
class Reserved:
    """What Reserve answers: the prompt's blocks, of which the first `cached_blocks` already
    hold its KV (a shared or reloaded prefix) and must not be pushed, and how much of the
    worker's headroom the reservation takes (in the admission policy's unit)."""

    block_ids: list[int]
    cached_blocks: int = 0
    headroom_cost: int = 0
    fence: int = 0  # the reservation's fencing token (decode/reservations.py)


# a lease or push window beyond this is a mistake, not a plan (a NaN one never ran out)
MAX_LEASE_S = 3600.0


def check_window(name: str, seconds: float) -> None:
    if not 0 <= seconds <= MAX_LEASE_S:  # False for NaN too
        raise ValueError(f"{name}: must be in [0, {MAX_LEASE_S:g}] seconds, got {seconds}")


class DecodeState:
    def __init__(
        self,
        core: EngineCore,
        config: DecodeConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = core
        self.config = config
        self.clock = clock
        self.estimator = OutputLengthEstimator()
        self.costs = PreemptionCosts()
        self.admission = ADMISSION[config.admission](
            core, self.estimator, config.admission_margin, self.costs
        )
        core.rotate_by(self.admission.rotation())
        self.reservations = Reservations()
        self.max_requests = max_requests(config, core.max_num_seqs)

    def reserve(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        lease_s: float = 0.0,
        push_window_s: float = 0.0,
        extra_tokens: int = 0,
        waiting: float | None = None,
        generated: int = 0,
    ) -> Reserved:
        """Raises ValueError (bad input: never servable) or ReservationError (no room now).
        `lease_s` and `push_window_s` of 0 mean the configured lease (and a push window as
        long as the lease: a caller that names none never renews either). `extra_tokens`:
        blocks for that many tokens more than the prompt (a migration's, decode/migrate.py).
        `waiting`: requests waiting for decode room per decode worker at the router, this
        one included (None: not known), which cost-aware admission reads. `generated`: the
        tokens it generated before (a migration's: the prompt ends with them), from which
        admission and the length estimator count its output."""
        check_window("lease_s", lease_s)
        check_window("push_window_s", push_window_s)
        if not 0 <= extra_tokens <= params.max_tokens:
            raise ValueError(f"extra_tokens: must be in [0, max_tokens], got {extra_tokens}")
        if not 0 <= generated < len(prompt):
            raise ValueError(f"generated_tokens: must be in [0, prompt length), got {generated}")
        req = self.core.make_request(prompt, params, request_id=request_id)
        req.prior_output_tokens = generated
        if request_id in self.reservations or self.core.holds(request_id):
            raise ValueError(f"request_id: {request_id!r} is already known here")
        held = self.held()
        if len(held) >= self.max_requests:
            raise ReservationError(
                f"requests: this worker holds {len(held)}, its most (max_requests "
                f"{self.max_requests}: each streams on a server thread)"
            )
        cap = req.output_cap  # its whole output's, counted from its start
        refused = self.admission.check(req.token_ids, cap, held, waiting, generated)
        if refused is not None:
            raise ReservationError(refused)
        cost = self.admission.cost(req.token_ids, cap, generated)
        try:
            cached_blocks = self.core.reserve(req, extra_tokens) // self.core.block_size
        except MemoryError as e:
            raise ReservationError(str(e)) from None
        lease = lease_s or self.config.default_lease_s
        t = self.clock()
        fence = self.reservations.add(
            Reservation(
                req,
                t + lease,
                cached_blocks,
                reserved_at=t,
                push_deadline=t + (push_window_s or lease),
            )
        )
        return Reserved(list(req.block_ids), cached_blocks, cost, fence)

    def renew(self, request_id: str, fence: int, lease_s: float) -> bool:
        """Extend a held reservation's lease -> False when it is not held (any more)."""
        check_window("lease_s", lease_s)
        return self.reservations.renew(request_id, fence, lease_s, self.clock())

    def note_arrivals(self, notes) -> None:
        self.reservations.note_arrivals(notes)

    def start(
        self, request_id: str, first_token: int, more: list[int] | tuple = ()
    ) -> tuple[Reservation, FinishedRequest | None]:
        """The prompt's KV is in the reserved blocks -> (the reservation, the request's output
        if its first token already finished it). `more`: tokens after the reserved prompt
        whose KV came in too (a migrated request's, generated while its KV moved); ValueError
        (the reservation ended) when its blocks cannot hold them."""
        res = self.reservations.pop(request_id)
        if res is None:
            raise UnknownRequest(f"no reservation for {request_id!r} (expired or released)")
        req = res.request
        if more:  # generated where it was while its KV moved: its output, counted so
            req.token_ids.extend(more)
            req.num_prompt_tokens += len(more)
            req.prior_output_tokens += len(more)
            if self.core.blocks_needed(req.num_tokens) > len(req.block_ids):
                self.core.release(req)
                raise ValueError(
                    f"more_token_ids: {req.num_tokens} tokens do not fit the "
                    f"{len(req.block_ids)} blocks reserved for {request_id!r}"
                )
        return res, self.core.admit_prefilled(req, first_token)

    def start_here(self, request_id: str) -> Reservation:
        """No prefill worker computes the prompt: this worker does, in its reserved blocks, in
        its next steps (conditional disaggregation) -> the reservation. Nothing was pushed
        into its blocks, and nothing can be: its push window is never used."""
        res = self.reservations.pop(request_id)
        if res is None:
            raise UnknownRequest(f"no reservation for {request_id!r} (expired or released)")
        self.core.admit_reserved(res.request)
        return res

    def release(
        self, request_id: str, unpushed: bool = False
    ) -> tuple[bool, FinishedRequest | None]:
        """Abort -> (whether it was known here, its output when it ended now; an abort during
        a step ends with that step's end_step). `unpushed`: the caller knows no push for its
        reservation was posted (no fence needed)."""
        res, free = self.reservations.end(request_id, self.clock(), unpushed)
        if res is not None:
            if free:
                self.core.release(res.request)
            return True, None
        done = self.core.abort(request_id)
        if done is not None:
            return True, done
        return self.core.is_aborting(request_id), None

    def expire(self) -> None:
        t = self.clock()
        for rid in self.reservations.expired(t):
            res, free = self.reservations.end(rid, t)
            if free:
                self.core.release(res.request)
        for res in self.reservations.unfenced(t):
            self.core.release(res.request)

    def observe(self, done: FinishedRequest) -> None:
        """A finished request teaches the estimator its output length (its driver calls
        this for every request that ends, from start(), release() or a step)."""
        if done.completed:
            self.estimator.observe(done.output_length)

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """A step's run took `seconds`: the costs the admission policy reads learn from it."""
        self.costs.observe_chunks(seconds, plan.batch.chunks)

    def held(self) -> list[HeldRequest]:
        """Every request whose KV this pool holds or will hold again."""
        return self.core.held() + [HeldRequest.of(r) for r in self.reservations.requests()]

    def stats(self) -> WorkerStats:
        s = self.core.stats()
        held = self.held()
        projected = projected_blocks(self.admission.pool, self.estimator, held)
        return WorkerStats(
            free_blocks=s.pool.free_blocks,
            total_blocks=s.pool.num_blocks,
            running=s.running,
            headroom_blocks=self.admission.headroom(held),
            projected_free_blocks=s.pool.num_blocks - projected,
            preempted=self.core.preempted(),
            parked=tuple(self.core.parked_ids(MAX_PARKED_IDS)),
        )

    def check_integrity(self) -> None:
        self.core.check_integrity(reserved=self.reservations.requests())
        self.reservations.check_integrity()
