"""`pdserve bench idle`: the CPU a launched cluster burns while it serves nothing.

A cluster that waits for requests should cost its node nothing: no thread spinning (NIXL's
own progress thread kept each worker at 99% of a core once), no loop waking often enough
to add up. The bench launches a cluster, serves one short request (every path warm: a
reservation, a KV push, a decode), waits until no worker holds a block or a spill entry
(the sweep's own check), then reads each
process's CPU time (user + system, /proc) over a window in which nothing is sent, and
reports each process's share of one core (its own total: threads that ended meanwhile
count), its busiest threads at the end (by their kernel names:
gRPC's and UCX's threads are named there, Python's are all "python"), and whether every
process stayed under the bar (2% of a core: the performance issue's).

    pdserve bench idle --prefill 1 --decode 2 --window 30 --json idle.json
"""

from __future__ import annotations

import math
import os
import time

from pdserve.bench.report import machine_info
from pdserve.bench.sweep import wait_drained
from pdserve.client import Client
from pdserve.launch import Cluster
from pdserve.progress import progress

BAR = 0.02  # of one core, every process
_TOP_THREADS = 4


def _cpu_seconds(stat: str) -> float:
    """utime + stime of a /proc .../stat line, in seconds."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds `pid` has used, every thread's, ended ones too (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        return _cpu_seconds(f.read())


def thread_cpu_seconds(pid: int) -> dict[tuple[int, str], float]:
    """(tid, kernel thread name) -> CPU seconds each thread of `pid` has used (Linux)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                used = _cpu_seconds(f.read())
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[(int(tid), name)] = used
    return out


def _alive(cluster: Cluster) -> None:
    """RuntimeError naming a process of the cluster that is gone (its CPU would read 0)."""
    gone = [n for n, p in zip(cluster.names, cluster.procs) if p.poll() is not None]
    if gone:
        raise RuntimeError(f"{', '.join(gone)} exited while the cluster was idle")


def bench_idle(
    model: str,
    prefill: int = 1,
    decode: int = 2,
    window_s: float = 30.0,
    transfer: str = "nixl",
    worker_args: list[str] | None = None,
    share_cpus: bool | None = None,
    router_idle: bool | None = None,
) -> dict:
    if not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"window: must be a number of seconds > 0, got {window_s}")
    if prefill < 1 or decode < 1:
        raise ValueError(f"a cluster needs a prefill and a decode worker, got {prefill}P{decode}D")
    with Cluster(
        model,
        prefill,
        decode,
        transfer=transfer,
        worker_args=worker_args,
        share_cpus=share_cpus,
        router_idle=router_idle,
    ) as cluster:
        with Client(cluster.address, security=cluster.security) as client:
            served = client.generate([1, 2, 3], max_tokens=3, temperature=0)
        wait_drained(cluster, [a for k, a in cluster.metrics.items() if k.startswith("decode")])
        _alive(cluster)
        pids = {name: proc.pid for name, proc in zip(cluster.names, cluster.procs)}
        total_before = {name: process_cpu_seconds(pid) for name, pid in pids.items()}
        before = {name: thread_cpu_seconds(pid) for name, pid in pids.items()}
        started = time.monotonic()
        ticks = max(1, round(window_s))
        for i in progress(range(ticks), desc="idle", unit="s", leave=False):
            time.sleep(max(0.0, started + window_s * (i + 1) / ticks - time.monotonic()))
        elapsed = time.monotonic() - started
        _alive(cluster)
        total = {name: process_cpu_seconds(pid) - total_before[name] for name, pid in pids.items()}
        after = {name: thread_cpu_seconds(pid) for name, pid in pids.items()}
    processes = {}
    for name in pids:
        used = {k: v - before[name].get(k, 0.0) for k, v in after[name].items()}
        busiest = sorted(used.items(), key=lambda kv: -kv[1])[:_TOP_THREADS]
        processes[name] = {
            "cpu_share": total[name] / elapsed,
            "threads": [
                {"tid": tid, "name": tname, "cpu_share": s / elapsed}
                for (tid, tname), s in busiest
                if s > 0
            ],
        }
    worst = max(p["cpu_share"] for p in processes.values())
    return {
        "bench": "idle",
        "machine": machine_info(),
        "model": model,
        "topology": f"{prefill}P{decode}D",
        "transfer": transfer,
        "warm_up_tokens": len(served.token_ids),
        "window_s": elapsed,
        "bar_cpu_share": BAR,
        "processes": processes,
        "max_cpu_share": worst,
        "under_bar": worst < BAR,
    }


def format_table(report: dict) -> str:
    lines = [
        f"idle {report['topology']} {report['model']} ({report['transfer']}), "
        f"{report['window_s']:.0f} s with no request, share of one core (bar "
        f"{100 * report['bar_cpu_share']:.0f}%):",
        f"{'process':<12} {'CPU':>7}  busiest threads",
    ]
    for name, p in report["processes"].items():
        threads = ", ".join(f"{t['name']} {100 * t['cpu_share']:.2f}%" for t in p["threads"])
        lines.append(f"{name:<12} {100 * p['cpu_share']:6.2f}%  {threads}")
    verdict = "every process under the bar" if report["under_bar"] else "over the bar"
    lines.append(f"worst {100 * report['max_cpu_share']:.2f}%: {verdict}")
    return "\n".join(lines)
