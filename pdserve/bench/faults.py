"""The faults `pdserve bench chaos` knows (pdserve/bench/chaos.py), with no imports beyond
the standard library: the CLI lists them in its help.

A worker fault is ROLE-HOW@STATE: SIGKILL (kill) or SIGSTOP for STOP_S then SIGCONT (stop)
of a prefill or decode worker at the moment a request reaches STATE. The moment is exact:
a failpoint (pdserve/failpoints.py) armed in the workers fires when the first request gets
there, and the worker strikes itself (kill, stop) or holds that state for PAUSE_S while the
bench strikes a peer (the decode worker a prefill is about to push to) or cancels the
client call of the request that fired it. The @migrate states and the migrate-dest faults
need a live migration under way: the bench drains the busiest decode worker once half of
the streams run (every stream on it moves to the other), and gives it requests again after
the phase.
"""

from __future__ import annotations

from types import MappingProxyType

STOP_S = 8.0  # a stopped worker stays stopped longer than the router's silence window (5 s)
PAUSE_S = 1.0  # a state held while the bench strikes a peer or cancels the client's call

STATES = MappingProxyType(
    {
        # the states of a request at which a decode worker fault strikes
        "decode": MappingProxyType(
            {
                "reserve": "its Reserve is granted, not yet answered",
                "push": "its KV is about to be pushed to it (the prefill holds there)",
                "stream": "its stream has handed over 4 tokens",
                "spill": "a preempted request's KV is about to be spilled",
                "reload": "a parked request's KV is about to be reloaded",
                "migrate": "a drained request's KV moves to the other decode worker (its "
                "last round, the request stopped)",
            }
        ),
        "prefill": MappingProxyType(
            {
                "accept": "a Prefill call is accepted, not yet queued",
                "push": "a batch is computed, its WRITEs not yet posted",
                "posted": "a batch's WRITEs are posted and in flight",
                "stream": "half of the streams have their first token (its work is done)",
            }
        ),
        # client cancels: the request that reaches the state is held there, then cancelled
        "cancel": MappingProxyType(
            {
                "reserve": "Reserve granted",
                "accept": "Prefill accepted",
                "push": "before its push",
                "stream": "4 tokens streamed",
                "spill": "while it is being spilled",
                "reload": "while it is being reloaded",
                "migrate": "while its KV moves to the other decode worker",
            }
        ),
    }
)


def _worker_faults() -> dict[str, str]:
    out = {}
    for role in ("decode", "prefill"):
        for state, what in STATES[role].items():
            out[f"{role}-kill@{state}"] = f"SIGKILL a {role} worker when {what}"
            out[f"{role}-stop@{state}"] = f"SIGSTOP it for {STOP_S:g} s there, then SIGCONT"
    for state, what in STATES["cancel"].items():
        out[f"cancel@{state}"] = f"the client cancels a request held at: {what}"
    return out


FAULT_HELP = MappingProxyType(
    {
        "none": "no fault: the baseline",
        **_worker_faults(),
        "cancel": "clients walk away from half of the streams mid-way",
        "stalled-push": "a prefill worker stalls before posting its push, past the router's "
        "prefill timeout (the decode reservation must stay fenced, then free)",
        "spill-full": "every write of the decode workers' disk tiers fails with ENOSPC",
        "spill-corrupt": "the spill files are overwritten while a reload is about to read them",
        "migrate-dest-kill": "SIGKILL the decode worker a drained request's KV is moving to, at "
        "the move's last round",
        "migrate-dest-stop": f"SIGSTOP it there for {STOP_S:g} s (past its reservations' lease), "
        "then SIGCONT",
        "router-restart": "SIGKILL the router; the supervisor starts it again",
        "black-hole": "a 'decode worker' that accepts connections and never answers registers",
    }
)
FAULTS = tuple(FAULT_HELP)
