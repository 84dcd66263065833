"""Which threads keep an OpenMP team: building an engine on a thread that goes away.

Torch's CPU kernels (and our C decode kernel) run their parallel regions on libgomp, the
OpenMP runtime torch ships. Every thread that runs a parallel region becomes the master of
its own team, and the team's threads live as long as that thread does. Between regions a
team's idle threads spin for a while before they sleep, so that the next region starts at
once, except when the process has more of these managed threads than it has CPUs: then
libgomp spins ~100 iterations and sleeps, and each region starts by waking its threads
(a futex and a context switch each, per region).

A worker that builds its model on one thread (loading and packing the weights, filling
the KV pool: parallel regions) and steps it on another (its step loop) has two teams. On a
2-CPU machine with 2 torch threads that is 3 managed threads for 2 CPUs, and the step
loop's team sleeps between every matmul. Measured on a 2-vCPU VM (SmolLM2-135M, a 1P1D
cluster, 16 streams): the decode worker's two compute threads switched ~1,400 and ~3,500
times a second and used 0.79 + 0.43 CPUs; with the engine built on a thread that exits
first, ~30 and 0 times a second, 0.81 + 0.79 CPUs, and `bench parity`'s medians went from
0.77-0.79 of the in-process engine to 0.80-0.89 (docs/benchmarks.md, "A cluster against
the engine it runs").

`on_own_thread` runs a function on a new thread and waits for it: when the thread exits,
libgomp frees its team, so the build leaves none behind. (A thread that runs torch work
later, say a migration's staging copy, forms a team of its own for as long as it lives;
on 2 CPUs a tiered-preemption run left none, as the process's thread count showed.)
Nothing that starts a child process may run there: a child that asked for a signal when
its parent dies (pdserve/lifetime.py, PR_SET_PDEATHSIG) gets it when the thread that
started it exits, not the process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_own_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a new thread that exits when it returns -> its result (or its
    exception, raised here). The caller waits, also when interrupted (a Ctrl-C here waits
    for the work to end, then is raised): this moves the work, it never leaves it running.
    Thread-local state does not follow (a CUDA current device, grad mode): pass what the
    work needs explicitly."""
    box: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            box["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=run, name="pdserve-build", daemon=True)
    thread.start()
    try:
        done.wait()
    except BaseException:
        # a half-built engine must not build on behind its caller's back. Not join(): once
        # interrupted, CPython 3.11's join() marks a live thread stopped (bpo-45274's fix
        # releases its lock), and the next join() returns at once
        done.wait()
        raise
    thread.join()  # its OpenMP team is freed as it exits
    error = box.pop("error", None)
    if error is not None:
        try:
            raise error  # type: ignore[misc]
        finally:
            del error, box  # the traceback holds the work's locals (a model, a pool)
    return box.pop("result")  # type: ignore[return-value]
