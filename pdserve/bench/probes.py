"""What a fault benchmark asks of a launched cluster (pdserve/launch.py) from the outside:
which processes run, which of them the router knows, whether the pools and spill tiers
emptied, how much memory each process holds. Plain reads: nothing here changes the cluster
but `whole()`, which lets the supervisor restart what died.

Registered workers are matched to processes by their gRPC address (the one each printed
in its READY line), never by parsing a worker id: ids are whatever `--worker-id` said.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter

import grpc

from pdserve.bench.prometheus import samples, scrape, total
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving import auth
from transfer.tiers.disk import OWNER, PREFIX


def live(cluster) -> list[tuple[str, int]]:
    """(name, pid) of every process of the cluster that runs now."""
    return [(n, p.pid) for n, p in zip(cluster.names, cluster.procs) if p.poll() is None]


def pid_of(cluster, name: str) -> int:
    return cluster.procs[cluster.names.index(name)].pid


def registered(cluster) -> dict[str, str]:
    """worker id -> process name (role-index) of every live process the router lists.
    Raises grpc.RpcError when the router does not answer."""
    by_address = {a: n for n, a in cluster.addresses.items()}
    return {w.worker_id: by_address[w.address] for w in listed(cluster)}


def listed(cluster) -> list[pb.WorkerInfo]:
    """The router's view of the workers that are live processes of this cluster."""
    running = {n for n, _ in live(cluster)}
    addresses = {a for n, a in cluster.addresses.items() if n in running}
    with auth.channel(cluster.address, cluster.security) as channel:
        workers = rpc.RouterStub(channel).ListWorkers(pb.Empty(), timeout=2).workers
    return [w for w in workers if w.address in addresses]


def router_outcomes(cluster) -> tuple[int, Counter] | None:
    """(the router's pid, its own count of request outcomes since it started:
    pdserve_router_requests_total by outcome); None when it does not answer."""
    try:
        text = scrape(cluster.metrics["router-0"], timeout_s=5)
    except OSError:
        return None
    counts = Counter(
        {
            s.labels["outcome"]: int(s.value)
            for s in samples(text)
            if s.name == "pdserve_router_requests_total"
        }
    )
    return pid_of(cluster, "router-0"), counts


def outcomes_since(before, after) -> dict[str, int] | None:
    """What the router counted between two `router_outcomes` reads; a router that was
    restarted in between (another pid) counts from zero, so then it is everything the new
    one counted. None when either read failed."""
    if before is None or after is None:
        return None
    (pid_before, counted), (pid_after, now) = before, after
    if pid_after != pid_before:
        counted = Counter()
    return dict(sorted((now - counted).items()))


def rss_mib(cluster) -> dict[str, float]:
    out = {}
    for name, pid in live(cluster):
        try:
            with open(f"/proc/{pid}/status") as f:
                kb = int(re.search(r"^VmRSS:\s+(\d+)", f.read(), re.M).group(1))
            out[name] = kb / 1024
        except (OSError, AttributeError):
            continue
    return out


def whole(cluster, supervisor, prefill: int, decode: int, timeout_s: float) -> bool:
    """Every process up (the supervisor restarting what died) and registered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        supervisor.step()
        try:
            roles = Counter(w.role for w in listed(cluster))
        except grpc.RpcError:
            time.sleep(0.2)
            continue
        up = len(live(cluster)) == len(cluster.procs)
        if up and roles == {"prefill": prefill, "decode": decode}:
            return True
        time.sleep(0.2)
    return False


def spill_dirs(root: str) -> dict[str, int | None]:
    """Spill directory -> the pid in its OWNER file (None: unreadable) under `root`."""
    out: dict[str, int | None] = {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, OWNER)) as f:
                out[path] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            out[path] = None
    return out


def spill_files(directory: str) -> list[str]:
    """The entry files (*.kv) in one spill directory."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(directory, n) for n in names if n.endswith(".kv"))


def leaks(cluster, supervisor, timeout_s: float, spill_root: str | None = None) -> dict:
    """What the live workers still hold once they settle (or at the deadline): device
    blocks (decode and prefill), spilled blocks and fenced reservations (decode /metrics),
    entry files in the live workers' spill directories, and spill directories whose owner
    is dead (a restarted worker removes them at start: pdserve/transfer/tiers/disk.py)."""
    deadline = time.monotonic() + timeout_s
    while True:
        supervisor.step()
        row = {"blocks": -1, "spill_blocks": 0, "fenced": 0, "spill_files": 0, "stale_dirs": 0}
        try:
            row["blocks"] = sum(w.total_blocks - w.free_blocks for w in listed(cluster))
            for name, _ in live(cluster):
                if name.startswith("decode"):
                    text = scrape(cluster.metrics[name])
                    row["spill_blocks"] += int(total(text, "pdserve_decode_spill_used_blocks"))
                    row["fenced"] += int(total(text, "pdserve_decode_reservations", state="fenced"))
        except (grpc.RpcError, OSError):
            row["blocks"] = -1
        if spill_root is not None:
            pids = {pid for _, pid in live(cluster)}
            for path, owner in spill_dirs(spill_root).items():
                if owner in pids:
                    row["spill_files"] += len(spill_files(path))
                else:
                    row["stale_dirs"] += 1
        settled = row["blocks"] == 0 and not any(
            row[k] for k in ("spill_blocks", "fenced", "spill_files", "stale_dirs")
        )
        if settled or time.monotonic() > deadline:
            return row
        time.sleep(0.5)


def busiest(cluster, role: str) -> tuple[str, int]:
    """(name, pid) of the live `role` worker with the most work now (decode: running
    requests; prefill: queued tokens), from its /metrics."""
    gauge = "pdserve_decode_running" if role == "decode" else "pdserve_prefill_queued_tokens"
    best, load = None, -1.0
    for name, pid in live(cluster):
        if name.startswith(role):
            try:
                value = total(scrape(cluster.metrics[name]), gauge)
            except OSError:
                continue
            if value > load:
                best, load = (name, pid), value
    if best is None:
        raise RuntimeError(f"no live {role} worker to strike")
    return best
