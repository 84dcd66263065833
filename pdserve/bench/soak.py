"""`pdserve bench soak`: many requests at a fixed concurrency on the chaos cluster
(pdserve/bench/chaos.py) while a decode worker and a prefill worker are SIGKILLed in turn
every `kill_every` completed requests and restarted by the supervisor; every process's RSS
is sampled every 100 requests. Counted like a chaos phase (lost, hung, duplicated, equal,
leaked), plus the RSS change of the processes that live through it (router, the second
prefill and decode workers) from warm-up to the end.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from pdserve.bench.chaos import (
    SETTLE_S,
    Load,
    Outcome,
    _summary,
    chaos_cluster,
    expected_tokens,
    prompts,
    scratch_dirs,
)
from pdserve.bench.probes import leaks, rss_mib, whole
from pdserve.progress import progress


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
    share_cpus: bool | None = None,
    router_idle: bool | None = None,
) -> dict:
    """`requests` requests at `concurrency`; every `kill_every` completions a decode or a
    prefill worker (the first of each role, in turn) is SIGKILLed and restarted."""
    from pdserve.launch import Supervisor
    from pdserve.weights import resolve

    vocab = resolve(model).config.vocab_size
    distinct = prompts(64, vocab, seed)
    expected = expected_tokens(model, distinct, max_tokens)
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="pdserve-soak-") as scratch,
        chaos_cluster(
            model, num_kv_blocks, *scratch_dirs(scratch), share_cpus, router_idle
        ) as cluster,
    ):
        spill_root = os.path.join(scratch, "spill")
        cpus = cluster.cpus()
        supervisor = Supervisor(cluster, log=lambda line: None)
        load = Load(cluster, max_tokens, "soak")
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
                pool.submit(load.one, i, distinct[i % len(distinct)]): i for i in range(requests)
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
        leaked = leaks(cluster, supervisor, SETTLE_S, spill_root)
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
            "kill_every": kill_every, "max_tokens": max_tokens, "seed": seed, "cpus": cpus,
            **row}  # fmt: skip
