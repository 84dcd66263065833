"""`pdserve bench chaos`: a launched, supervised cluster (2 prefill + 2 decode workers, small
decode pools that spill to disk, so that requests are preempted, spilled and reloaded)
under greedy load while one fault at a time hits it (pdserve/bench/faults.py: every worker
fault at each state of a request, client cancels at each state, a stalled push, a full and
a corrupted spill tier, a router restart, a black hole), then the checks a user would make:

    completed   requests whose final message came, and of those `equal`: tokens equal to
                the colocated engine's (greedy), `duplicated_tokens` beyond max_tokens
    resumed     completed requests the router moved to another worker (timings.resumes)
    failed      requests that ended with a gRPC status, by status (typed, documented:
                docs/faults.md)
    hung        requests with no answer by their deadline; lost: ended with neither a final
                message nor a status
    leaked      blocks held on the live workers, blocks and entry files in their spill
                tiers, fenced reservations, spill directories of dead processes, once the
                phase is over and the pools had time to settle
    rss_mib     every process's resident memory at the end of the phase

How each fault strikes: pdserve/bench/strike.py. Killed processes are restarted by the
supervisor (pdserve/launch.py) before the next fault. The soak: pdserve/bench/soak.py.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from pdserve.bench.faults import FAULTS
from pdserve.bench.probes import leaks, outcomes_since, router_outcomes, rss_mib, whole
from pdserve.bench.strike import Strike
from pdserve.client import Client, StreamEnded, timings_of
from pdserve.progress import progress

DEADLINE_S = 120.0  # a request with no answer by then is hung
SETTLE_S = 45.0  # after a phase, the pools must be whole within this
# the router's prefill timeout for the chaos cluster: fences of pushes that a killed
# prefill worker never finished end within it (docs/faults.md)
PREFILL_TIMEOUT_S = 10.0
ROUNDS = 3  # loads at most per fault, until its state is reached


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    final: dict | None = None  # timings of the final message
    status: str = ""  # the gRPC status it ended with, when it did
    seconds: float = 0.0
    walked_away: bool = False  # the client cancelled it (the cancel faults)
    reconnects: int = 0  # times the SDK sent it again to a restarted router
    details: str = ""  # of the status


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
    """Requests against the router from a thread pool, each with its own request id
    (`TAG-i`); `started` counts streams that have their first token; `cancel(id)` makes
    the client walk away from one of them."""

    def __init__(self, cluster, max_tokens: int, tag: str = "r") -> None:
        self.cluster, self.max_tokens, self.tag = cluster, max_tokens, tag
        self.started = 0
        self._calls: dict[str, object] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()

    def one(self, i: int, prompt: list[int], walk_away_after: int = 0) -> Outcome:
        """One request through the SDK (pdserve/client.py: a router that restarts under it
        is reconnected to, and the request continued)."""
        out, t0 = Outcome(), time.monotonic()
        rid = f"{self.tag}-{i}"
        params = dict(max_tokens=self.max_tokens, temperature=0, ignore_eos=True)

        serving = None  # the call that brought the last message: a call after it that
        # brings one is a reconnect (a retry that reached no router brings none)

        def on_call(call) -> None:
            nonlocal serving
            if serving is None:  # the first call: a router that dies before its first
                serving = call  # message is still reconnected to, and counted
            with self._lock:
                self._calls[rid] = call

        with Client(self.cluster.address, security=self.cluster.security) as client:
            messages = client.messages(
                prompt, on_call, timeout_s=DEADLINE_S, request_id=rid, **params
            )
            try:
                for msg in messages:
                    if (call := self._calls.get(rid)) is not serving:
                        out.reconnects += serving is not None
                        serving = call
                    if msg.token_ids and not out.tokens:
                        with self._lock:
                            self.started += 1
                    out.tokens.extend(msg.token_ids)
                    if msg.finished:
                        out.final = timings_of(msg.timings)
                    if walk_away_after and len(out.tokens) >= walk_away_after:
                        self.cancel(rid)
                        break
            except grpc.RpcError as e:
                out.status, out.details = e.code().name, e.details() or ""
            except StreamEnded as e:  # no status either: counted lost
                out.details = str(e)
            finally:
                messages.close()
                with self._lock:
                    self._calls.pop(rid, None)
                    out.walked_away = rid in self._cancelled
        out.seconds = time.monotonic() - t0
        return out

    def cancel(self, rid: str) -> bool:
        """The client cancels request `rid` -> False when it is not in flight."""
        with self._lock:
            call = self._calls.get(rid)
            if call is None:
                return False
            self._cancelled.add(rid)
        call.cancel()
        return True


def run_phase(
    fault, cluster, supervisor, prompt_set, expected, concurrency, max_tokens, tag, where
) -> dict:
    """One fault against a whole cluster under `len(prompt_set)` requests; `where` holds
    the failpoint directory and the spill root (bench_chaos). A fault whose state the load
    did not reach (no request happened to be spilled, say) gets the load again, up to
    ROUNDS times: `rounds` says how many it took, `struck` whether it ever fired."""
    load = Load(cluster, max_tokens, tag)
    strike = Strike.arm(fault, cluster, *where, concurrency, PREFILL_TIMEOUT_S)
    walk = max(1, max_tokens // 3) if fault == "cancel" else 0
    started, outcomes, rounds = time.monotonic(), [], 0
    try:
        while rounds < ROUNDS and (rounds == 0 or not strike.struck):
            base, rounds = len(outcomes), rounds + 1
            with ThreadPoolExecutor(concurrency) as pool:
                futures = [
                    pool.submit(load.one, base + i, p, walk if i % 2 == 0 else 0)
                    for i, p in enumerate(prompt_set)
                ]
                while not all(f.done() for f in futures):
                    supervisor.step()
                    strike.poll(load)
                    time.sleep(0.02)
                outcomes += [f.result() for f in futures]
    finally:
        strike.finish()
    wall = time.monotonic() - started
    row = _summary(fault, outcomes, expected * rounds, max_tokens, wall, strike.struck)
    row.update(note=strike.note, rounds=rounds)
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
        # continued by the SDK on a restarted router (router-restart)
        "reconnected": sum(1 for o, _ in completed if o.reconnects),
        "walked_away": sum(1 for o in outcomes if o.walked_away),
        "failed": dict(sorted(failed.items())),
        "hung": len(hung),
        "lost": sum(1 for o in ended if not o.status),
        # every request that did not complete: what it had and how it ended
        "unfinished": [
            dict(
                tokens=len(o.tokens),
                status=o.status,
                details=o.details[:200],
                reconnects=o.reconnects,
                seconds=round(o.seconds, 2),
                walked_away=o.walked_away,
            )
            for o in outcomes
            if o.final is None
        ],
        "wall_s": round(wall, 2),
    }


def scratch_dirs(scratch: str) -> tuple[str, str]:
    """(failpoint directory, spill root) under `scratch`, made."""
    out = (os.path.join(scratch, "failpoints"), os.path.join(scratch, "spill"))
    for path in out:
        os.mkdir(path)
    return out


def chaos_cluster(
    model: str,
    num_kv_blocks: int,
    failpoint_dir: str,
    spill_root: str,
    share_cpus: bool | None = None,
    router_idle: bool | None = None,
):
    """2 prefill + 2 decode workers; the decode pools spill straight to disk (no host or
    CXL tier) under `spill_root`, so that spill files exist to leak or corrupt, and admit
    greedily: the default policy admits no further than the expected peak of the demand
    while requests wait in line (past it only by what the tiers hold, with no line) and,
    when spills fail (spill-full), keeps its spread inside the pool, which would leave the
    spill and reload states mostly unreached."""
    from pdserve.launch import Cluster

    return Cluster(
        model,
        2,
        2,
        worker_args=["--failpoints", failpoint_dir],
        prefill_args=["--num-kv-blocks", "256"],
        decode_args=[
            *("--num-kv-blocks", str(num_kv_blocks), "--spill-dir", spill_root),
            *("--spill-host-blocks", "0", "--spill-cxl-blocks", "0", "--admission", "greedy"),
        ],
        router_args=["--prefill-timeout", str(PREFILL_TIMEOUT_S)],
        share_cpus=share_cpus,
        router_idle=router_idle,
    )


def bench_chaos(
    model: str,
    faults: tuple[str, ...] = FAULTS,
    requests: int = 24,
    concurrency: int = 8,
    max_tokens: int = 48,
    num_kv_blocks: int = 20,
    seed: int = 0,
    share_cpus: bool | None = None,
    router_idle: bool | None = None,
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
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as scratch:
        where = scratch_dirs(scratch)
        with chaos_cluster(model, num_kv_blocks, *where, share_cpus, router_idle) as cluster:
            cpus = cluster.cpus()
            supervisor = Supervisor(cluster, log=lambda line: None)
            for n, fault in enumerate(progress(faults, desc="bench chaos", unit="fault")):
                if not whole(cluster, supervisor, 2, 2, 180):
                    raise RuntimeError(f"the cluster did not come back whole before {fault}")
                counted = router_outcomes(cluster)
                row = run_phase(
                    fault, cluster, supervisor, prompt_set, expected, concurrency, max_tokens,
                    f"p{n}", where,
                )  # fmt: skip
                whole(cluster, supervisor, 2, 2, 180)
                row["leaked"] = leaks(cluster, supervisor, SETTLE_S, where[1])
                # the router's side of the same requests, read once the pools settled (a
                # handler still unwinding a cancel is counted by then): a stream the client
                # saw end without its final message shows as failed_internal, a router bug.
                # The router finishes what it had already sent before a client walked away.
                row["router_outcomes"] = outcomes_since(counted, router_outcomes(cluster))
                row["rss_mib"] = rss_mib(cluster)
                row["restarts_so_far"] = supervisor.restarts
                rows.append(row)
    return {
        "benchmark": "chaos",
        "model": model,
        "topology": "2 prefill + 2 decode, supervised, decode spills to disk",
        "requests_per_fault": requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "decode_num_kv_blocks": num_kv_blocks,
        "seed": seed,
        "cpus": cpus,
        "faults": rows,
        "wall_s": round(time.monotonic() - started, 1),
    }


def ok(report: dict) -> bool:
    rows = report["faults"] if report["benchmark"] == "chaos" else [report]
    return all(
        r["struck"]  # the fault happened
        and r["completed"] + sum(r["failed"].values()) + r["hung"] + r["lost"] + r["walked_away"]
        == r["requests"]
        and r["hung"] == 0
        and r["lost"] == 0
        and "INTERNAL" not in r["failed"]  # the router's own bug, whatever it did after
        and not (r.get("router_outcomes") or {}).get("failed_internal")
        and r["duplicated_tokens"] == 0
        and r["equal"] == r["completed"]
        and r["leaked"]["blocks"] == 0
        and r["leaked"]["spill_blocks"] == 0
        and r["leaked"].get("spill_files", 0) == 0
        and r["leaked"].get("stale_dirs", 0) == 0
        and r["leaked"].get("fenced", 0) == 0
        for r in rows
    )


def format_table(report: dict) -> str:
    rows = report["faults"] if report["benchmark"] == "chaos" else [report]
    lines = [
        f"pdserve bench {report['benchmark']}: {report['model']}, seed {report['seed']}, "
        f"{report.get('topology', '2 prefill + 2 decode, supervised')}",
        f"{'fault':<22} {'reqs':>4} {'done':>4} {'equal':>5} {'resumed':>7} {'failed':<22} "
        f"{'hung':>4} {'lost':>4} {'dup':>3} {'leaked':>6} {'s':>6}",
    ]
    for r in rows:
        failed = ", ".join(f"{k} {v}" for k, v in r["failed"].items()) or "-"
        leaked = r["leaked"]
        held = sum(max(0, leaked.get(k, 0)) for k in ("blocks", "spill_blocks", "spill_files"))
        held += leaked.get("stale_dirs", 0) + (1 if leaked["blocks"] < 0 else 0)
        name = r["fault"] if r["struck"] else f"{r['fault']} (not struck)"
        lines.append(
            f"{name:<22} {r['requests']:>4} {r['completed']:>4} {r['equal']:>5} "
            f"{r['resumed']:>7} {failed:<22} {r['hung']:>4} {r['lost']:>4} "
            f"{r['duplicated_tokens']:>3} {held:>6} {r['wall_s']:>6.1f}"
        )
    if report["benchmark"] == "soak":
        lines.append(f"kills: {len(report['kills'])}; RSS change of long-lived processes "
                     f"after warm-up: {report['rss_change_long_lived']}")  # fmt: skip
    return "\n".join(lines)
