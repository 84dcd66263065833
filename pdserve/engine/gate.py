"""The admission gate of a colocated engine: requests wait in front of the core until its
admission policy (pdserve/engine/admission.py) lets them in, arrival order kept.

The decode worker gates each reservation itself (decode/state.py); a colocated engine (the
offline `LLM`, the simulator's replicas, `pdserve sim vs-real`) has no reservations, so this
is its gate: the same policies, fed the same inputs (each step's measured time and chunks
for the cost model, each completed request's length for the estimator). `greedy` lets every
request straight into the scheduler's own queue, as the engine always did.
"""

from __future__ import annotations

import time
from collections import deque

from pdserve.engine.admission import (
    ADMISSION,
    DEFAULT_MARGIN,
    GreedyAdmission,
    KVAwareAdmission,
    check_admission,
    waiting_per_worker,
)
from pdserve.engine.core import EngineCore, EngineStalled, StepPlan
from pdserve.engine.costs import PreemptionCosts
from pdserve.engine.length_estimator import OutputLengthEstimator
from pdserve.engine.output import FinishedRequest, HeldRequest, StepOutput
from pdserve.engine.request import Request


def make_admission(
    policy: str, core: EngineCore, margin: float = DEFAULT_MARGIN
) -> GreedyAdmission | None:
    """The policy over `core`'s pool, or None for greedy (nothing to gate)."""
    check_admission(policy, margin)
    cls = ADMISSION[policy]
    if not issubclass(cls, KVAwareAdmission):
        return None
    admission = cls(core, OutputLengthEstimator(), margin, PreemptionCosts())
    core.rotate_by(admission.rotation())
    return admission


class AdmissionGate:
    def __init__(self, core: EngineCore, admission: GreedyAdmission | None) -> None:
        self.core, self.admission = core, admission
        self.pending: deque[Request] = deque()

    def offer(self, request: Request) -> None:
        self.pending.append(request)

    def admit(self) -> None:
        """Into the engine, in arrival order, while the policy agrees. No more than a step's
        worth (max_num_seqs) is held at once: the scheduler could not run more together, and
        each check reads every held request (10,000 prompts given at once would cost
        quadratic time for nothing)."""
        held: list[HeldRequest] | None = None  # read once, then kept up to date here
        while self.pending:
            req = self.pending[0]
            if self.admission is not None and self.core.has_unfinished:
                # (an idle engine takes anything: it must progress)
                held = self.core.held() if held is None else held
                if len(held) >= self.core.max_num_seqs:
                    return
                # the line is this request and those queued behind it, all for this engine
                waiting = waiting_per_worker(len(self.pending), 1)
                refused = self.admission.check(req.token_ids, req.params.max_tokens, held, waiting)
                if refused is not None:
                    return
            self.core.add(self.pending.popleft())
            if held is not None:
                held.append(HeldRequest.of(req))

    def headroom(self) -> int:
        """Blocks a new request could still count on (what a router ranks replicas by)."""
        if self.admission is None:
            return self.core.free_blocks
        return self.admission.headroom(self.core.held())

    def stepped(self, plan: StepPlan, seconds: float) -> None:
        """A step's run took `seconds`: the cost model learns from it."""
        if self.admission is not None:
            self.admission.costs.observe_chunks(seconds, plan.batch.chunks)

    def finished(self, done: FinishedRequest) -> None:
        """A request left the engine: a completed one's length teaches the estimator."""
        if self.admission is not None and done.completed:
            self.admission.estimator.observe(done.output_length)

    def step(self) -> StepOutput:
        """Admit what the policy lets in, then one whole step of the engine, timed for the
        cost model (the colocated LLM's loop; the gate owns every block of the pool)."""
        self.admit()
        plan = self.core.begin_step()
        if plan is None:
            if self.busy:
                raise EngineStalled("the scheduler made no progress with requests waiting")
            return StepOutput()
        ran = time.monotonic()
        result = self.core.run(plan)
        self.stepped(plan, time.monotonic() - ran)
        out = self.core.end_step(plan, result)
        for done in out.finished:
            self.finished(done)
        return out

    @property
    def busy(self) -> bool:
        return bool(self.pending) or self.core.has_unfinished
