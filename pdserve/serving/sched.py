"""A process that yields the CPUs to the forward passes of workers on the same node.

On a CPU node the router does no model compute: per token it wakes to relay a chunk from a
decode worker to a client. Each such wake-up under the default scheduling policy preempts a
worker's compute thread in the middle of a parallel region, and the step waits at its next
barrier for the preempted thread (~880 involuntary switches a second of the decode
worker's compute threads at 32 streams; docs/benchmarks.md, "The router at idle
priority"). Under Linux's SCHED_IDLE the router runs when a CPU would otherwise idle, or on
the small share the kernel gives idle-class threads when none does: two busy loops on this
VM's 2 CPUs delayed an idle-class thread's 10 ms sleep by 2 ms at the median, 4 ms at p99,
22 ms at worst (a normal one's: 0.1 / 1 / 4 ms), so its deadlines (seconds) are not at
risk.

Only for a process that does no compute: a worker's own gRPC threads measured slower at
idle (the turn its lease asks for, the tokens its streams hand over wait behind compute).
"""

from __future__ import annotations

import contextlib
import os

# /proc/<pid>/task/<tid>/stat, after the ")" closing the name: field 41 (policy) of proc(5)
_POLICY_FIELD = 41 - 3


def yield_cpus() -> str | None:
    """Put every thread of this process, and every thread it starts later (they inherit it),
    in SCHED_IDLE -> None when done, else why not (not Linux, or refused)."""
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is None or not os.path.isdir("/proc/self/task"):
        return "SCHED_IDLE: not on this platform"
    try:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # that thread ended meanwhile
                os.sched_setscheduler(int(tid), idle, os.sched_param(0))
    except OSError as e:  # a container may refuse scheduling calls (EPERM)
        return f"SCHED_IDLE: {e}"
    return None


def thread_policies(pid: int) -> dict[int, int]:
    """{thread id: scheduling policy (os.SCHED_*)} of every thread of `pid` (Linux)."""
    policies = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # that thread ended meanwhile
        policies[int(tid)] = int(fields[_POLICY_FIELD])
    return policies
