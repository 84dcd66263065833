"""The capacity trap at its own scale, SIMULATED: the runs behind docs/capacity-trap-at-scale.md.

    python scripts/capacity_at_scale.py --out docs/results/capacity-at-scale [--only NAME]
        [--policies greedy+recompute,kv-aware+tiered,cost-aware+tiered]

Every part writes its own JSON (and plots) as it finishes, so a long run can be resumed
with --only. Parts:

    arithmetic    KV capacity per GPU and per node from the configs, next to the simulator's
    qwen-<layout>-<workload>  Qwen2.5-32B on 8 x H200: throughput, latencies, preemptions and
                  recomputed tokens against node concurrency for each policy. A DP layout is
                  simulated as one replica with 1/DP of the clients (a balanced router), and
                  its throughput scaled by DP; `stranded` runs all eight replicas
    stranded      DP=8, all eight replicas at 400 clients: headroom routing against round-robin
    deepseek      the DeepSeek-V3-shaped MLA model, FP8 weights, TP=8
    deepseek-dpattn-reasoning-steady  the same at TP=8 with attention data-parallel over
                  the 8 ranks (how MLA is served), one rank simulated with 1/8 of the clients
    trtllm-16827  Llama-3.3-70B FP8 on one H200, 16k in / 512 out, concurrency 32: greedy
                  (MAX_UTILIZATION) against kv-aware admission (GUARANTEED_NO_EVICT)
    vllm-44594    Qwen2.5-7B, ~1k in / ~5k out, concurrency 128, a 299,584-token pool:
                  greedy (no watermark) against kv-aware admission
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: E402

from pdserve.bench.report import write_json  # noqa: E402
from pdserve.bench.workload import RequestSpec  # noqa: E402
from pdserve.engine.args import EngineArgs  # noqa: E402
from pdserve.sim.engine import kv_blocks  # noqa: E402
from pdserve.sim.load import SLO  # noqa: E402
from pdserve.sim.plots import plot_sim  # noqa: E402
from pdserve.sim.profile import load_profile  # noqa: E402
from pdserve.sim.run import Setup, Topology, simulate  # noqa: E402
from pdserve.sim.shape import ModelShape  # noqa: E402
from pdserve.sim.sweep import Load, sim_sweep  # noqa: E402
from pdserve.weights import model_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "pdserve", "sim", "configs")
POLICIES = ["greedy+recompute", "kv-aware+tiered"]
NODE_CONCURRENCY = [100, 400, 1600, 5000]
# a datacenter GPU's batch limits (our choice; LLM's CPU defaults would cap the batch
# before KV does); the same for every policy
ARGS = EngineArgs(max_num_seqs=1024, max_num_batched_tokens=8192)
REASONING = dict(kind="reasoning", mean_output=10000, max_output=30000, requests_per_client=2)
# six requests per client, read after the first wave (`warm_tok_s`): with two, the busy
# window is mostly the first wave, every context starting empty at once, which holds more
# requests than a steady state does (contexts spread over their lives) and flatters the
# policy that admits the most at the start
REASONING_STEADY = dict(REASONING, requests_per_client=6)
AZURE = dict(kind="azure-conv", requests_per_client=2)
AZURE_STEADY = dict(AZURE, requests_per_client=6)
LAYOUTS = {
    "dp8": Topology(dp=1, tp=1),
    "tp2dp4": Topology(dp=1, tp=2),
    "tp8": Topology(tp=8),
    # attention data-parallel over the 8 ranks (MLA): one rank simulated with 1/8 of the
    # clients, as DP=8 simulates one replica (a rank's cost assumes the others as loaded)
    "tp8dpa": Topology(tp=8, dp_attention=True, attention_ranks=1),
}
REPLICAS = {"dp8": 8, "tp2dp4": 4, "tp8": 1, "tp8dpa": 8}  # pools holding different requests


def config(name: str):
    return model_config(os.path.join(CONFIGS, f"{name}.json"))


def arithmetic() -> dict:
    """KV room per GPU and per node, by hand next to the simulator's kv_blocks()."""
    h200 = load_profile("h200")
    rows = []
    for model, weight_bytes, layouts in (
        ("qwen2.5-32b", 2, (("DP=8", 1, 8), ("TP=2 x DP=4", 2, 4), ("TP=8", 8, 1))),
        # under DP attention each of the 8 ranks holds its own requests' whole latent
        ("deepseek-v3", 1, (("TP=8", 8, 1), ("TP=8, DP attention", 8, 8))),
    ):
        c = config(model)
        for name, tp, replicas in layouts:
            dp_attention = "DP attention" in name
            shape = ModelShape.of(c, weight_bytes, 2, tp, dp_attention)
            usable = h200.memory_bytes * h200.usable_fraction - h200.activation_reserve_bytes
            free = usable - shape.weight_bytes
            tokens_gpu_share = free / shape.kv_bytes_per_token  # tokens whose KV one GPU holds
            replica_tokens = tokens_gpu_share  # each token of a replica is on all its GPUs
            blocks = kv_blocks(h200, shape, 16)
            rows.append(
                {
                    "model": model,
                    "layout": name,
                    "tp": tp,
                    "dp_attention": dp_attention,
                    "replicas": replicas,  # pools holding different requests
                    "weight_gb_per_gpu": shape.weight_bytes / 1e9,
                    "kv_bytes_per_token_per_gpu": shape.kv_bytes_per_token,
                    "usable_gb_per_gpu": usable / 1e9,
                    "kv_gb_per_gpu": free / 1e9,
                    "kv_gb_per_node": free * 8 / 1e9,
                    "tokens_per_replica": replica_tokens,
                    "tokens_per_node": replica_tokens * replicas,
                    "sim_blocks_per_replica": blocks,
                    "sim_tokens_per_node": blocks * 16 * replicas,
                    "requests_at_10k_per_node": replica_tokens * replicas / 10_048,
                    "requests_at_10k_per_gpu": replica_tokens * replicas / 10_048 / 8,
                }
            )
    return {"profile": "h200", "rows": rows}


def sweep(
    name: str, model: str, layout: str, workload: dict, out: str, weight_bytes=2, node_conc=None
) -> dict:
    topo = LAYOUTS[layout]
    replicas = REPLICAS[layout]
    setup = Setup(config(model), load_profile("h200"), topo, ARGS, weight_bytes, SLO(2.0, 0.1))
    conc = [max(1, c // replicas) for c in node_conc or NODE_CONCURRENCY]
    report = sim_sweep(setup, POLICIES, conc, Load(**workload), label=f"{model} {layout}")
    report["node"] = {"layout": layout, "replicas": replicas, "gpus": 8}
    for p in report["points"]:
        p["node_concurrency"] = p["concurrency"] * replicas
        p["node_throughput_tok_s"] = p["throughput_tok_s"] * replicas
        p["node_goodput_req_s"] = p["goodput_req_s"] * replicas
    plot_sim(report, os.path.join(out, name))
    for p in report["points"]:
        p["kv_usage_peak"] = max(
            (kv for pts in p["series"].values() for _, kv, _ in pts), default=0
        )
        p.pop("series")  # plotted; too long for the JSON
    return report


def stranded(out: str) -> dict:
    """All eight replicas at two concurrencies: headroom routing against round-robin."""
    points = []
    for route in ("headroom", "round-robin"):
        topo = Topology(dp=8, route=route)
        setup = Setup(config("qwen2.5-32b"), load_profile("h200"), topo, ARGS)
        load = Load(**REASONING)
        for c in (400,):  # 50 clients per replica: twice what one replica holds at full length
            for policy in POLICIES:
                specs = load.for_point(c, 0)
                p = simulate(setup, policy, specs, c, label=f"{route} {policy} c={c}")
                p["route"] = route
                p["spread"] = usage_spread(p.pop("series"))
                points.append(p)
    return {"points": points}


def usage_spread(series: dict) -> dict:
    """Over time (1 s bins): the most and least used replica's KV fraction, and how often
    one replica is over 95% while another is under 70% (capacity stranded)."""
    bins: dict[int, dict[str, float]] = {}
    for worker, pts in series.items():
        for t, kv, _bw in pts:
            bins.setdefault(int(t), {})[worker] = kv
    full = [b for b in bins.values() if len(b) == len(series)]
    if not full:
        return {}
    spread = [max(b.values()) - min(b.values()) for b in full]
    stranded_bins = [b for b in full if max(b.values()) > 0.95 and min(b.values()) < 0.7]
    return {
        "bins": len(full),
        "mean_spread": sum(spread) / len(spread),
        "stranded_fraction": len(stranded_bins) / len(full),
    }


def fixed(n: int, prompt: int, output: int) -> list[RequestSpec]:
    return [RequestSpec(0.0, prompt, output) for _ in range(n)]


def trtllm_16827() -> dict:
    """TensorRT-LLM #16827's W-C arm: Llama-3.3-70B FP8 on one H200, 128 requests of exactly
    16,384 prompt tokens and 512 output tokens (ignore_eos), 32 closed-loop clients;
    MAX_UTILIZATION (admit while the prompt fits, evict when KV runs out: our greedy) against
    GUARANTEED_NO_EVICT (admit only what can finish: our kv-aware admission, which counts
    expected decode growth)."""
    c = config("llama-3.3-70b")
    specs = fixed(128, 16384, 512)
    setup = Setup(
        c, load_profile("h200"), Topology(), dataclasses.replace(ARGS, max_model_len=17000), 1
    )
    out = {"num_kv_blocks": setup.num_blocks()}
    for name, policy in (
        ("max_utilization", "greedy+recompute"),
        ("no_evict", "kv-aware+recompute"),
    ):
        p = simulate(setup, policy, specs, 32, label=f"trt-llm {name}")
        p.pop("series")
        out[name] = p
    e, n = out["max_utilization"], out["no_evict"]
    out["throughput_change"] = e["throughput_tok_s"] / n["throughput_tok_s"] - 1
    out["tpot_p99_ratio"] = e["tpot_p99_s"] / n["tpot_p99_s"] if n["tpot_p99_s"] else None
    out["measured"] = {"throughput_change": -0.406, "tpot_p99_ratio": 9.1, "hardware": "H200"}
    return out


def uniform_specs(n: int, prompt: int, output: int, spread: float, seed: int) -> list[RequestSpec]:
    """Lengths uniform in [x (1 - spread), x (1 + spread)] (vLLM's --random-range-ratio)."""
    import random

    rnd = random.Random(seed)

    def draw(x: int) -> int:
        return rnd.randint(int(x * (1 - spread)), int(x * (1 + spread)))

    return [RequestSpec(0.0, draw(prompt), draw(output)) for _ in range(n)]


def vllm_44594() -> dict:
    """vLLM PR #44594's benchmark: Qwen2.5-7B, 450 prompts of ~1,000 in / ~5,000 out (+-20%,
    ignore_eos), 128 clients, max_num_seqs 256, prefix caching off, a KV pool of 299,584
    tokens; no watermark (our greedy) against admission that keeps room for growth (ours is
    kv-aware, not a fixed watermark)."""
    c = config("qwen2.5-7b")
    specs = uniform_specs(450, 1000, 5000, 0.2, seed=0)
    blocks = 299_584 // 16
    args = EngineArgs(
        num_kv_blocks=blocks, max_num_seqs=256, max_model_len=8192, enable_prefix_caching=False
    )
    setup = Setup(c, load_profile("h200"), Topology(), args)
    out = {"num_kv_blocks": blocks}
    for policy in ("greedy+recompute", "kv-aware+recompute", "kv-aware+tiered"):
        p = simulate(setup, policy, specs, 128, label=f"vllm-44594 {policy}")
        p.pop("series")
        out[policy] = p
    out["measured"] = {
        "off": {"preemptions": 1065, "throughput_tok_s": 11582, "ttft_p50_s": 6.56,
                "ttft_p99_s": 25.51, "itl_p99_ms": 40.62},
        "watermark_0.05": {"preemptions": 187, "throughput_tok_s": 12167, "ttft_p50_s": 11.20,
                           "ttft_p99_s": 28.94, "itl_p99_ms": 17.70},
        "hardware": "GB200",
    }  # fmt: skip
    return out


PARTS = {
    "arithmetic": lambda out: arithmetic(),
    **{
        f"qwen-{layout}-{wname}": (
            lambda out, layout=layout, wname=wname, w=w: sweep(
                f"qwen-{layout}-{wname}",
                "qwen2.5-32b",
                layout,
                w,
                out,
                # one TP=8 replica simulates all eight GPUs' work: 10k-token outputs at 5,000
                # clients would take an hour here
                node_conc=NODE_CONCURRENCY[:3] if (layout, wname) == ("tp8", "reasoning") else None,
            )
        )
        for layout in ("dp8", "tp2dp4", "tp8")
        for wname, w in (("reasoning", REASONING), ("azure", AZURE))
    },
    "qwen-dp8-reasoning-steady": lambda out: sweep(
        "qwen-dp8-reasoning-steady", "qwen2.5-32b", "dp8", REASONING_STEADY, out
    ),
    "qwen-dp8-azure-steady": lambda out: sweep(
        "qwen-dp8-azure-steady", "qwen2.5-32b", "dp8", AZURE_STEADY, out
    ),
    # up to 1,600 node clients: at 5,000 (1,250 per TP=2 replica) the cost-aware point ran
    # at 2.5 requests/s here, ~40 minutes for that point alone
    "qwen-tp2dp4-reasoning-steady": lambda out: sweep(
        "qwen-tp2dp4-reasoning-steady",
        "qwen2.5-32b",
        "tp2dp4",
        REASONING_STEADY,
        out,
        node_conc=NODE_CONCURRENCY[:3],
    ),
    # one TP=8 replica simulates all eight GPUs' work: to 1,600 node clients (~3x the
    # two-request run's 16 minutes here)
    "qwen-tp8-reasoning-steady": lambda out: sweep(
        "qwen-tp8-reasoning-steady",
        "qwen2.5-32b",
        "tp8",
        REASONING_STEADY,
        out,
        node_conc=NODE_CONCURRENCY[:3],
    ),
    "stranded": stranded,
    "deepseek-reasoning": lambda out: sweep(
        "deepseek-reasoning",
        "deepseek-v3",
        "tp8",
        REASONING,
        out,
        weight_bytes=1,
        node_conc=NODE_CONCURRENCY[:2],
    ),
    "deepseek-reasoning-steady": lambda out: sweep(
        "deepseek-reasoning-steady",
        "deepseek-v3",
        "tp8",
        REASONING_STEADY,
        out,
        weight_bytes=1,
        node_conc=NODE_CONCURRENCY[:2],
    ),
    # the MLA model as it is served (2026-12-07): TP=8 with DP attention, 6.3x the KV room
    "deepseek-dpattn-reasoning-steady": lambda out: sweep(
        "deepseek-dpattn-reasoning-steady",
        "deepseek-v3",
        "tp8dpa",
        REASONING_STEADY,
        out,
        weight_bytes=1,
    ),
    "trtllm-16827": lambda out: trtllm_16827(),
    "vllm-44594": lambda out: vllm_44594(),
}


def tables(out: str) -> str:
    """Markdown tables of every sweep found under `out` (node figures)."""
    lines = []
    for name in PARTS:
        path = os.path.join(out, f"{name}.json")
        if not name.startswith(("qwen-", "deepseek-")) or not os.path.exists(path):
            continue
        with open(path) as f:
            report = json.load(f)
        lines += [
            f"#### {name}",
            "",
            "| policy | clients | tok/s (node) | after the first wave | TTFT p50 / p99 (s) "
            "| TPOT p50 / p99 (ms) | e2e p50 (s) | preemptions | recomputed / generated "
            "| peak KV |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        replicas = report["node"]["replicas"]
        for p in report["points"]:
            ratio = p["recomputed_tokens"] / max(p["generated_tokens"], 1)
            warm = p.get("warm_tok_s")
            warm = "-" if warm is None else f"{warm * replicas:,.0f}"
            lines.append(
                f"| {p['policy']} | {p['node_concurrency']} | {p['node_throughput_tok_s']:,.0f} "
                f"| {warm} "
                f"| {p['ttft_p50_s']:.1f} / {p['ttft_p99_s']:.1f} "
                f"| {p['tpot_p50_s'] * 1e3:.1f} / {p['tpot_p99_s'] * 1e3:.1f} "
                f"| {p['e2e_p50_s']:.0f} | {p['preemptions']:,} | {ratio:.2f} "
                f"| {p.get('kv_usage_peak', 0):.0%} |"
            )
        for policy, a in report["analysis"].items():
            worst = a["worst_past_knee_fraction"]
            lines.append(
                f"\n{policy}: peak {a['peak_tok_s'] * report['node']['replicas']:,.0f} tok/s at "
                f"{a['knee_concurrency'] * report['node']['replicas']} clients; worst past the "
                f"knee {'-' if worst is None else f'{worst:.0%}'} of the peak"
            )
        lines += warm_lines(report)
        lines.append("")
    return "\n".join(lines)


def warm_lines(report: dict) -> list[str]:
    """Per policy, after the first wave: its peak, how far it falls past that, and how it
    compares with greedy+recompute at each concurrency."""
    by = {}
    for p in report["points"]:
        if p.get("warm_tok_s") is not None:
            by.setdefault(p["policy"], []).append(p)
    base = {p["concurrency"]: p["warm_tok_s"] for p in by.get("greedy+recompute", [])}
    lines = []
    for policy, pts in by.items():
        peak = max(pts, key=lambda p: p["warm_tok_s"])
        past = [p["warm_tok_s"] / peak["warm_tok_s"] for p in pts
                if p["concurrency"] > peak["concurrency"]]  # fmt: skip
        vs = [f"{p['node_concurrency']}: {p['warm_tok_s'] / base[p['concurrency']]:.2f}x"
              for p in pts if base.get(p["concurrency"])]  # fmt: skip
        lines.append(
            f"{policy}, after the first wave: peak "
            f"{peak['warm_tok_s'] * report['node']['replicas']:,.0f} tok/s at "
            f"{peak['node_concurrency']} clients; worst past it "
            f"{f'{min(past):.0%}' if past else '-'}; against greedy+recompute {', '.join(vs)}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/capacity-at-scale")
    parser.add_argument("--only", default=None, help=f"comma-separated: {', '.join(PARTS)}")
    parser.add_argument("--tables", action="store_true", help="print the sweeps as markdown")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated admission+preemption policies of the sweeps and `stranded`",
    )
    args = parser.parse_args()
    POLICIES[:] = args.policies.split(",")
    if args.tables:
        print(tables(args.out))
        return 0
    names = args.only.split(",") if args.only else list(PARTS)
    for name in names:
        if name not in PARTS:
            parser.error(f"--only: unknown part {name!r}; choose from {', '.join(PARTS)}")
    os.makedirs(args.out, exist_ok=True)
    for name in names:
        started = time.perf_counter()
        result = PARTS[name](args.out)
        result["wall_s"] = time.perf_counter() - started
        result["simulated"] = True
        write_json(result, os.path.join(args.out, f"{name}.json"))
        print(f"{name}: {result['wall_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
