"""`pdserve bench chaos`: a launched, supervised cluster (2 prefill + 2 decode workers, small
decode pools so that requests are preempted and spilled) under greedy load while one fault
at a time hits it, then the checks a user would make:

    completed   requests whose final message came, and of those `equal`: tokens equal to
                the colocated engine's (greedy), `duplicated_tokens` beyond max_tokens
    resumed     completed requests the router moved to another worker (timings.resumes)
    failed      requests that ended with a gRPC status, by status (typed, documented:
                docs/faults.md)
    hung        requests with no answer by their deadline; lost: ended with neither a final
                message nor a status
    leaked      blocks held on the live workers, and blocks in their spill tiers, once
                the phase is over and the pools had time to settle
    rss_mib     every process's resident memory at the end of the phase

Faults (FAULTS): none, decode-kill / decode-stop (the decode worker running the most
requests; a stopped one gets SIGCONT after STOP_S), prefill-kill / prefill-stop (the one
with the most queued tokens); each of these four strikes twice, at the `handoff` moment
(the first request is on its way: Reserve, prefill and push running) and at `streaming`
(half of the concurrent streams have their first token),
router-restart (SIGKILL; the supervisor starts it again on its port), cancel (clients walk
away from half of the streams mid-way), black-hole (a fake decode worker that accepts
connections and never answers registers with the cluster's credentials). Killed processes
are restarted by the supervisor (pdserve/launch.py) before the next fault.

`soak` runs many requests at a fixed concurrency while a decode worker and a prefill worker
are killed in turn every `kill_every` requests, and samples every process's RSS.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from pdserve.bench.faults import FAULTS, STOP_S
from pdserve.client import build_request, timings_of
from pdserve.progress import progress
from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving import auth

MOMENTS = ("handoff", "streaming")  # when a worker fault strikes (_due)
DEADLINE_S = 120.0  # a request with no answer by then is hung
SETTLE_S = 45.0  # after a phase, the pools must be whole within this
# the router's prefill timeout for the chaos cluster: fences of pushes that a killed
# prefill worker never finished end within it (docs/faults.md)
PREFILL_TIMEOUT_S = 10.0


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    final: dict | None = None  # timings of the final message
    status: str = ""  # the gRPC status it ended with, when it did
    seconds: float = 0.0
    walked_away: bool = False  # the client cancelled it (the cancel fault)


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of 20-80 tokens, fixed by the seed."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(20, 81))] for _ in range(n)]


def expected_tokens(model: str, prompt_set: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pdserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.token_ids for o in LLM(model).generate(prompt_set, params)]


class Load:
    """Requests against the router from a thread pool; `started` counts streams that have
    their first token (the faults wait for it)."""

    def __init__(self, cluster, max_tokens: int) -> None:
        self.cluster, self.max_tokens = cluster, max_tokens
        self.started = 0
        self.sent = 0  # requests on their way (the handoff moment strikes at the first)
        self._lock = threading.Lock()

    def one(self, prompt: list[int], walk_away_after: int = 0) -> Outcome:
        out, t0 = Outcome(), time.monotonic()
        params = dict(max_tokens=self.max_tokens, temperature=0, ignore_eos=True)
        with self._lock:
            self.sent += 1
        with auth.channel(self.cluster.address, self.cluster.security) as channel:
            call = rpc.RouterStub(channel).Generate(
                build_request(prompt, params), timeout=DEADLINE_S
            )
            try:
                for msg in call:
                    if msg.token_ids and not out.tokens:
                        with self._lock:
                            self.started += 1
                    out.tokens.extend(msg.token_ids)
                    if msg.finished:
                        out.final = timings_of(msg.timings)
                    if walk_away_after and len(out.tokens) >= walk_away_after:
                        out.walked_away = True
                        call.cancel()
                        break
            except grpc.RpcError as e:
                out.status = e.code().name
        out.seconds = time.monotonic() - t0
        return out


def _metric(text: str, name: str) -> float:
    """The sum of a series (every label set of it, unless `name` names one)."""
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
    return sum(float(m) for m in re.findall(pattern, text, re.M))


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        return r.read().decode()


def live(cluster) -> list[tuple[str, int]]:
    """(name, pid) of every process of the cluster that runs now."""
    return [(n, p.pid) for n, p in zip(cluster.names, cluster.procs) if p.poll() is None]


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
        pids = {pid for _, pid in live(cluster)}
        try:
            with auth.channel(cluster.address, cluster.security) as channel:
                workers = rpc.RouterStub(channel).ListWorkers(pb.Empty(), timeout=2).workers
        except grpc.RpcError:
            time.sleep(0.2)
            continue
        mine = [w for w in workers if _pid(w.worker_id) in pids]
        roles = Counter(w.role for w in mine)
        if len(pids) == len(cluster.procs) and roles == {"prefill": prefill, "decode": decode}:
            return True
        time.sleep(0.2)
    return False


def _pid(worker_id: str) -> int:
    """pdserve serve names workers ROLE-PID-SUFFIX."""
    parts = worker_id.split("-")
    return int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else -1


def leaks(cluster, supervisor, timeout_s: float) -> dict:
    """Blocks held, spilled blocks and fenced reservations on the live decode workers (and
    blocks on the live prefill workers), once they settle or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        supervisor.step()
        held = spill = fenced = 0
        try:
            with auth.channel(cluster.address, cluster.security) as channel:
                workers = rpc.RouterStub(channel).ListWorkers(pb.Empty(), timeout=2).workers
            pids = {pid for _, pid in live(cluster)}
            held = sum(w.total_blocks - w.free_blocks for w in workers if _pid(w.worker_id) in pids)
            for name, _ in live(cluster):
                if name.startswith("decode"):
                    text = scrape(cluster.metrics[name])
                    spill += _metric(text, "pdserve_decode_spill_used_blocks")
                    fenced += _metric(text, 'pdserve_decode_reservations{state="fenced"}')
        except (grpc.RpcError, OSError):
            held = -1
        if (held == 0 and spill == 0) or time.monotonic() > deadline:
            return {"blocks": held, "spill_blocks": int(spill), "fenced": int(fenced)}
        time.sleep(0.5)


def _busiest(cluster, role: str) -> tuple[str, int]:
    """(name, pid) of the live `role` worker with the most work now (decode: running
    requests; prefill: queued tokens), from its /metrics."""
    gauge = "pdserve_decode_running" if role == "decode" else "pdserve_prefill_queued_tokens"
    best, load = None, -1.0
    for name, pid in live(cluster):
        if name.startswith(role):
            try:
                value = _metric(scrape(cluster.metrics[name]), gauge)
            except OSError:
                continue
            if value > load:
                best, load = (name, pid), value
    if best is None:
        raise RuntimeError(f"no live {role} worker to strike")
    return best


def black_hole(cluster) -> tuple[Callable[[], None], str]:
    """A "decode worker" that accepts connections and never answers (a listening socket
    nobody reads), registered with the cluster's own credentials and an irresistible
    headroom -> (what closes it, the router's answer to its registration)."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    info = pb.WorkerInfo(
        worker_id="black-hole",
        role="decode",
        address=f"127.0.0.1:{hole.getsockname()[1]}",
        total_blocks=1 << 20,
        free_blocks=1 << 20,
        headroom_blocks=1 << 20,
    )
    try:
        with auth.channel(cluster.address, cluster.security) as channel:
            rpc.RouterStub(channel).Register(
                pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=info), timeout=10
            )
        answer = "OK"
    except grpc.RpcError as e:
        answer = e.code().name
    return hole.close, answer


def inject(fault: str, cluster, supervisor) -> tuple[Callable[[], None] | None, str]:
    """Strike now -> (what undoes it later, if anything: SIGCONT, closing a socket; a note
    on what happened)."""
    if fault in ("none", "cancel"):
        return None, ""
    if fault == "black-hole":
        close, answer = black_hole(cluster)
        return close, f"its registration was answered {answer}"
    if fault == "router-restart":
        os.kill(cluster.procs[0].pid, signal.SIGKILL)
        return None, "router-0 SIGKILLed"
    role, how = fault.split("-")
    name, pid = _busiest(cluster, role)
    if how == "kill":
        os.kill(pid, signal.SIGKILL)
        return None, f"{name} SIGKILLed"
    os.kill(pid, signal.SIGSTOP)
    return (lambda: os.kill(pid, signal.SIGCONT)), f"{name} SIGSTOPped for {STOP_S:g} s"


def _due(moment: str, load: Load, concurrency: int) -> bool:
    """handoff: as soon as the first request is on its way (its Reserve, prefill and push
    are running); streaming: once half of the concurrent streams have their first token."""
    if moment == "handoff":
        return load.sent >= 1
    return load.started >= max(1, concurrency // 2)


def run_phase(
    fault, cluster, supervisor, prompt_set, expected, concurrency, max_tokens, moment="streaming"
):
    load = Load(cluster, max_tokens)
    walk = max(1, max_tokens // 3) if fault == "cancel" else 0
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [
            pool.submit(load.one, p, walk if (fault == "cancel" and i % 2 == 0) else 0)
            for i, p in enumerate(prompt_set)
        ]
        undo, undo_at = None, None
        struck, note = False, ""
        while not all(f.done() for f in futures):
            supervisor.step()
            if not struck and _due(moment, load, concurrency):
                (undo, note), struck = inject(fault, cluster, supervisor), True
                undo_at = time.monotonic() + STOP_S
            if undo is not None and time.monotonic() >= undo_at:
                undo()
                undo = None
            time.sleep(0.02)
        if undo is not None:
            undo()
        outcomes = [f.result() for f in futures]
    wall = time.monotonic() - started
    row = _summary(fault, outcomes, expected, max_tokens, wall, struck)
    row.update(note=note, moment=moment)
    return row


def _summary(fault, outcomes, expected, max_tokens, wall, struck) -> dict:
    completed = [(o, want) for o, want in zip(outcomes, expected) if o.final is not None]
    ended = [o for o in outcomes if o.final is None and not o.walked_away]
    hung = [o for o in ended if o.status == "DEADLINE_EXCEEDED" and o.seconds >= DEADLINE_S - 1]
    # any status but a hang, CANCELLED included (the client walking away is not in `ended`)
    failed = Counter(o.status for o in ended if o.status and o not in hung)
    return {
        "fault": fault,
        "struck": struck,
        "requests": len(outcomes),
        "completed": len(completed),
        # greedy: an output with a token lost or repeated is not equal
        "equal": sum(1 for o, want in completed if o.tokens == want),
        "duplicated_tokens": sum(max(0, len(o.tokens) - max_tokens) for o, _ in completed),
        "resumed": sum(1 for o, _ in completed if o.final.get("resumes", 0) > 0),
        "walked_away": sum(1 for o in outcomes if o.walked_away),
        "failed": dict(sorted(failed.items())),
        "hung": len(hung),
        "lost": sum(1 for o in ended if not o.status),
        "wall_s": round(wall, 2),
    }


def _cluster(model: str, num_kv_blocks: int):
    from pdserve.launch import Cluster

    return Cluster(
        model,
        2,
        2,
        prefill_args=["--num-kv-blocks", "256"],
        decode_args=["--num-kv-blocks", str(num_kv_blocks)],
        router_args=["--prefill-timeout", str(PREFILL_TIMEOUT_S)],
    )


def bench_chaos(
    model: str,
    faults: tuple[str, ...] = FAULTS,
    requests: int = 24,
    concurrency: int = 8,
    max_tokens: int = 48,
    num_kv_blocks: int = 48,
    seed: int = 0,
) -> dict:
    from pdserve.launch import Supervisor
    from pdserve.weights import resolve

    for fault in faults:
        if fault not in FAULTS:
            raise ValueError(f"fault: {fault!r} is not one of {', '.join(FAULTS)}")
    vocab = resolve(model).config.vocab_size
    prompt_set = prompts(requests, vocab, seed)
    expected = expected_tokens(model, prompt_set, max_tokens)
    rows = []
    started = time.monotonic()
    with _cluster(model, num_kv_blocks) as cluster:
        supervisor = Supervisor(cluster, log=lambda line: None)
        # a worker fault strikes once at each moment; the others once, mid-stream
        plan = [
            (fault, moment)
            for fault in faults
            for moment in (MOMENTS if fault.split("-")[0] in ("decode", "prefill") else MOMENTS[1:])
        ]
        for fault, moment in progress(plan, desc="bench chaos", unit="fault"):
            if not whole(cluster, supervisor, 2, 2, 180):
                raise RuntimeError(f"the cluster did not come back whole before {fault}")
            row = run_phase(
                fault, cluster, supervisor, prompt_set, expected, concurrency, max_tokens, moment
            )
            whole(cluster, supervisor, 2, 2, 180)
            row["leaked"] = leaks(cluster, supervisor, SETTLE_S)
            row["rss_mib"] = rss_mib(cluster)
            row["restarts_so_far"] = supervisor.restarts
            rows.append(row)
    return {
        "benchmark": "chaos",
        "model": model,
        "topology": "2 prefill + 2 decode, supervised",
        "requests_per_fault": requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "decode_num_kv_blocks": num_kv_blocks,
        "seed": seed,
        "faults": rows,
        "wall_s": round(time.monotonic() - started, 1),
    }


def _supervise(supervisor, stop: threading.Event) -> None:
    while not stop.wait(0.05):
        supervisor.step()


def bench_soak(
    model: str,
    requests: int = 2000,
    concurrency: int = 16,
    kill_every: int = 200,
    max_tokens: int = 16,
    num_kv_blocks: int = 64,
    seed: int = 0,
) -> dict:
    """`requests` requests at `concurrency`; every `kill_every` completions a decode or a
    prefill worker (the first of each role, in turn) is SIGKILLed and restarted."""
    from pdserve.launch import Supervisor
    from pdserve.weights import resolve

    vocab = resolve(model).config.vocab_size
    distinct = prompts(64, vocab, seed)
    expected = expected_tokens(model, distinct, max_tokens)
    started = time.monotonic()
    with _cluster(model, num_kv_blocks) as cluster:
        supervisor = Supervisor(cluster, log=lambda line: None)
        load = Load(cluster, max_tokens)
        samples: list[dict] = []
        kills: list[str] = []
        outcomes: list[Outcome | None] = [None] * requests
        victims = ("decode-0", "prefill-0")
        bar = progress(total=requests, desc="bench soak", unit="req")
        # restarts block until the process is ready (seconds): on their own thread, so the
        # kills keep their pace
        stop = threading.Event()
        keeper = threading.Thread(target=_supervise, args=(supervisor, stop), daemon=True)
        keeper.start()
        with ThreadPoolExecutor(concurrency) as pool:
            futures = {
                pool.submit(load.one, distinct[i % len(distinct)]): i for i in range(requests)
            }
            done, next_kill = 0, kill_every
            while done < requests:
                finished = [f for f in futures if f.done()]
                for f in finished:
                    outcomes[futures.pop(f)] = f.result()
                    done += 1
                    bar.update(1)
                    if done % 100 == 0:
                        samples.append({"done": done, **rss_mib(cluster)})
                if done >= next_kill and done < requests:
                    victim = victims[len(kills) % 2]
                    index = cluster.names.index(victim)
                    # a victim still restarting (the supervisor backs off) is struck once up
                    if cluster.procs[index].poll() is None:
                        os.kill(cluster.procs[index].pid, signal.SIGKILL)
                        kills.append(f"{victim} after {done}")
                        next_kill = done + kill_every
                time.sleep(0.02)
        stop.set()
        keeper.join()
        whole(cluster, supervisor, 2, 2, 180)
        leaked = leaks(cluster, supervisor, SETTLE_S)
    want = [expected[i % len(distinct)] for i in range(requests)]
    row = _summary("soak", outcomes, want, max_tokens, time.monotonic() - started, True)
    long_lived = [n for n in ("router-0", "prefill-1", "decode-1")]
    warm = next(
        (s for s in samples if s["done"] >= min(400, requests // 4)), samples[0] if samples else {}
    )
    last = samples[-1] if samples else {}
    row.update(
        kills=kills,
        leaked=leaked,
        rss_samples_mib=samples,
        rss_change_long_lived={
            n: round(last[n] / warm[n] - 1, 4) for n in long_lived if n in warm and n in last
        },
    )
    return {"benchmark": "soak", "model": model, "concurrency": concurrency,
            "kill_every": kill_every, "max_tokens": max_tokens, "seed": seed, **row}  # fmt: skip


def ok(report: dict) -> bool:
    rows = report["faults"] if report["benchmark"] == "chaos" else [report]
    return all(
        r["struck"]  # the fault happened
        and r["completed"] + sum(r["failed"].values()) + r["hung"] + r["lost"] + r["walked_away"]
        == r["requests"]
        and r["hung"] == 0
        and r["lost"] == 0
        and r["duplicated_tokens"] == 0
        and r["equal"] == r["completed"]
        and r["leaked"]["blocks"] == 0
        and r["leaked"]["spill_blocks"] == 0
        for r in rows
    )


def format_table(report: dict) -> str:
    rows = report["faults"] if report["benchmark"] == "chaos" else [report]
    lines = [
        f"pdserve bench {report['benchmark']}: {report['model']}, seed {report['seed']}, "
        f"{report.get('topology', '2 prefill + 2 decode, supervised')}",
        f"{'fault':<21} {'reqs':>5} {'done':>5} {'equal':>5} {'resumed':>7} {'failed':<22} "
        f"{'hung':>4} {'lost':>4} {'dup':>4} {'leaked blk/spill':>16} {'s':>6}",
    ]
    for r in rows:
        failed = ", ".join(f"{k} {v}" for k, v in r["failed"].items()) or "-"
        leaked = f"{r['leaked']['blocks']}/{r['leaked']['spill_blocks']}"
        name = (
            r["fault"] if r.get("moment", "streaming") == "streaming" else f"{r['fault']}@handoff"
        )
        lines.append(
            f"{name:<21} {r['requests']:>5} {r['completed']:>5} {r['equal']:>5} "
            f"{r['resumed']:>7} {failed:<22} {r['hung']:>4} {r['lost']:>4} "
            f"{r['duplicated_tokens']:>4} {leaked:>16} {r['wall_s']:>6.1f}"
        )
    if report["benchmark"] == "soak":
        lines.append(f"kills: {len(report['kills'])}; RSS change of long-lived processes "
                     f"after warm-up: {report['rss_change_long_lived']}")  # fmt: skip
    return "\n".join(lines)
