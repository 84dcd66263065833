"""`pdserve sim calibrate`: measure this machine's real engine and fit a profile of it.

    engine     the in-process engine (`LLM`'s core) under closed loops of 1-32 clients over
               prompts of 32-1,024 tokens with short outputs, then one wave of 64-token
               outputs per batch size (decode-only steps), then each prompt length split
               k ways (k prompts of c / k tokens, one output: prefill-only steps), driven
               as `bench sim-vs-real` drives it; every step's work and cycle time, fitted
               linear in what the step computes (pdserve/sim/fit.py)
    tiers      a park + unpark through each real spill tier (host, CXL, disk) of 1 and of
               `big` blocks: latency and bytes/s from the two
    cluster    (with --cluster) a launched 1P1D cluster on this machine: its decode workers'
               steps and its prefill batches, read off the requests' traces (decode.step and
               prefill.compute spans, with each request's context), fitted the same way; the
               handoff's calls (reserve, the prefill RPC's transit, start) as medians of
               their spans; the push's bytes/s from the transfer tails

On CUDA the same command measures the GPU (the engine's device). The profile is JSON
(pdserve/sim/profile.py); `pdserve sim --profile FILE` uses it.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time

import torch

from pdserve.bench.workload import RequestSpec, prompts_for
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine, tiers
from pdserve.engine.core import EngineCore
from pdserve.engine.cuda_graphs import warm_up_graphs
from pdserve.kv.offload import OffloadedKV
from pdserve.progress import progress
from pdserve.sim.cost import StepWork
from pdserve.sim.fit import fit_steps

DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
CONTEXTS = (32, 128, 512, 1024)
# each context c also as k prompts of c // k tokens at once (k <= the largest batch): steps
# of the same prefill tokens and k prefilling sequences. The main grid's prefill steps have
# as many prefilling sequences as clients (its waves arrive together), so without these the
# fit tells prefill_seqs from prefill_tokens only where two points' batch x context happen
# to match, which a --batches/--contexts grid need not give. Cost: 2 one-step waves per
# (c, k), 2 x 3 x 4 = 24 prefill steps of 2 x 3 x 1,696 prompt tokens on the default grid,
# against ~1,000 steps and 2 x 63 x 1,696 = 213,696 prompt tokens (~5% more prefill work)
PREFILL_SPLITS = (1, 2, 4)
# features not fitted on a CPU: `prefill_step`, a fixed cost of a step that carries a prefill,
# is a GPU's (an eager prefill step beside decode steps replayed from CUDA graphs,
# pdserve/sim/cost.py). On this 2-vCPU VM its fit wandered from 2.1 to 14.0 to 31.1 ms between
# calibrations of the same engine (2026-12-05 to -07), and the simulated first token at low
# load was slow by about that (1.36-1.46x with 31.1 ms; 0.95-1.01x re-simulated with it at 0,
# docs/simulator.md): the grid's prefill steps do not tell it from the intercept and the cost
# per prompt token, and small prompts paid it in full
CPU_WITHOUT = ("prefill_step",)


def measure_engine(
    core: EngineCore,
    batches=DECODE_BATCHES,
    contexts=CONTEXTS,
    outputs: int = 12,
    seed: int = 0,
    decode_outputs: int = 64,
) -> list[tuple[StepWork, float]]:
    """Closed loops of `b` clients over prompts of `c` tokens, run as the real benchmark
    runs the engine (pdserve/sim/replica.py run_real): each step's work and cycle time."""
    from pdserve.sim.replica import Replica, run_real

    vocab = core.model_config.vocab_size
    samples: list[tuple[StepWork, float]] = []
    warm = [RequestSpec(0.0, 8, 2)]
    run_real(Replica("warm-up", core), warm, prompts_for(warm, vocab, seed), 1, label="warm-up")
    # on CUDA: every decode graph the grid can meet, captured before any step is timed
    longest = max(contexts) + max(outputs, decode_outputs)
    warm_up_graphs(core, max(batches), -(-longest // core.kv.cache.block_size))
    # the grid: (clients, prompt tokens, outputs, requests). Prompts of every context,
    # short outputs (mixed prefill/decode steps); one wave of long outputs per batch size
    # (decode-only steps, as serving mostly runs); each context split k ways, one output
    # (prefill steps of k sequences and the same tokens: PREFILL_SPLITS says why)
    grid = [(b, c, outputs, 2 * b) for b in batches for c in contexts]
    grid += [(b, min(contexts), decode_outputs, b) for b in batches]
    splits = [k for k in PREFILL_SPLITS if k <= max(batches)]
    grid += [(k, c // k, 1, 2 * k) for c in contexts for k in splits if c // k > 1]
    for i, (b, c, out, n) in enumerate(progress(grid, desc="calibrate engine", unit="point")):
        specs = [RequestSpec(0.0, c, out)] * n
        replica = Replica(f"b{b}-c{c}", core)
        run_real(replica, specs, prompts_for(specs, vocab, seed + i), b, samples=samples, label="")
    return samples


def tier_costs(one: float, many: float, block_bytes: int, big: int) -> tuple[float, float]:
    """(latency, bytes/s) of a tier operation from its median times for 1 and `big` blocks:
    the line through the two. The big size is chosen so that its copy dominates; when the
    single block took half as long as the big one or more, noise decided the line (a
    2026-12-07 calibration here: a 7.9 ms single-block park, the 32 MiB one no slower,
    which read as a fixed 7.9 ms at an infinite rate), so the big operation alone gives the
    rate and the latency is taken as none: a tier then costs what its big copies took."""
    if big < 2:
        raise ValueError(f"tier costs: need two sizes to tell latency from rate, got {big}")
    if many > 2 * one:
        rate = (big - 1) * block_bytes / (many - one)
        return max(0.0, one - block_bytes / rate), rate
    return 0.0, big * block_bytes / max(many, 1e-9)


def measure_tiers(core: EngineCore, args: EngineArgs, reps: int = 5) -> dict:
    """Per tier: latency and bytes/s of a park and an unpark (1 block, and `big` blocks of
    about 32 MiB together: big enough that the copy, not the fixed cost, dominates). The
    two sizes alternate, so that both see the same moments of a shared machine; the first
    round of each warms the tier up and is not counted."""
    cache = core.kv.cache
    # on CUDA a reload's copy to the device and its unpack are queued: wait for them
    sync = torch.cuda.synchronize if cache.pool.device.type == "cuda" else (lambda: None)
    block_bytes = cache.nbytes // cache.num_blocks
    big = int(min(max(8, (32 << 20) // block_bytes), cache.num_blocks // 2))
    if big < 2 or reps < 1:
        raise ValueError(
            f"calibrate tiers: a pool of at least 4 blocks and 1 round, got "
            f"{cache.num_blocks} blocks and {reps}"
        )
    out = {}
    for tier in tiers(args, cache):
        offload = OffloadedKV(cache, [tier])
        times: dict[int, tuple[list[float], list[float]]] = {1: ([], []), big: ([], [])}
        for _ in range(reps + 1):
            for n, (s_times, r_times) in times.items():
                ids = list(range(n))
                start = time.perf_counter()
                assert offload.park("calibrate", ids) == tier.name
                if hasattr(tier, "flush"):
                    tier.flush()
                middle = time.perf_counter()
                assert offload.unpark("calibrate", ids)
                sync()
                s_times.append(middle - start)
                r_times.append(time.perf_counter() - middle)
        offload.close()
        (s1, r1), (sb, rb) = ([statistics.median(t[1:]) for t in times[n]] for n in (1, big))
        spill_latency, spill_rate = tier_costs(s1, sb, block_bytes, big)
        reload_latency, reload_rate = tier_costs(r1, rb, block_bytes, big)
        fixed = [t for t in (spill_latency, reload_latency) if t > 0]  # one latency a tier
        out[tier.name] = {
            "spill_bytes_s": spill_rate,
            "reload_bytes_s": reload_rate,
            "latency_s": min(fixed, default=0.0),
        }
    return out


def device_memory_bytes(device: torch.device) -> float:
    """What the engine's device holds: the GPU's memory on CUDA, the host's RAM on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def usable_memory(device: torch.device) -> dict:
    """What of the device's memory a simulated replica may fill with weights and KV: all of
    a host's RAM (the CPU engine's pool is sized by hand); on a GPU what the built-in
    roofline profiles assume (pdserve/sim/profiles/h200.json: 90%, less 4 GB for activations
    and workspace), not measured by this command."""
    if device.type == "cuda":
        return {"usable_fraction": 0.9, "activation_reserve_bytes": 4.0e9}
    return {"usable_fraction": 1.0, "activation_reserve_bytes": 0.0}


def step_records(samples: list[tuple[StepWork, float]]) -> list[dict]:
    """Every measured step as plain data (its work and seconds), for fits made later."""
    return [{**dataclasses.asdict(work), "seconds": seconds} for work, seconds in samples]


def calibrate(
    model: str,
    num_kv_blocks: int = 2048,
    threads: int | None = None,
    samples_out: list[dict] | None = None,
    batches=DECODE_BATCHES,
    contexts=CONTEXTS,
) -> dict:
    """The in-process engine and its tiers -> a fitted profile (a JSON-ready dict).
    `samples_out`, when given, receives every measured step (step_records)."""
    if threads:
        torch.set_num_threads(threads)
    args = EngineArgs(
        num_kv_blocks=num_kv_blocks,
        enable_prefix_caching=False,  # every step computes what it is given
        preemption="tiered",
        max_num_seqs=max(batches),
    )
    core, _ = build_engine(model, args)
    try:
        samples = measure_engine(core, batches=tuple(batches), contexts=tuple(contexts))
        if samples_out is not None:
            samples_out.extend(step_records(samples))
        on_cpu = core.kv_pool.device.type == "cpu"
        left_out = CPU_WITHOUT if on_cpu else ()
        coefficients, fit = fit_steps(samples, without=left_out)
        measured_tiers = measure_tiers(core, args)
    finally:
        core.close()
    dtype = str(core.kv_pool.dtype).removeprefix("torch.")
    device = str(core.kv_pool.device)
    if left_out:
        fit["left_out"] = list(left_out)
    when = time.strftime("%Y-%m-%d")
    return {
        "_about": f"{model} measured by `pdserve sim calibrate` on {platform.node()} ({when})",
        "name": f"{device}-{platform.node()}",
        "kind": "fitted",
        "dtype": dtype,
        "memory_bytes": device_memory_bytes(core.kv_pool.device),
        **usable_memory(core.kv_pool.device),
        "engine": coefficients,
        "tiers": measured_tiers,
        "link": {"bytes_s": 4.0e9, "latency_s": 0.0},
        "fit": {"engine": fit},
        "sources": {
            "engine": f"measured: {fit['steps']} steps of the {model} engine on {device} "
            f"({torch.get_num_threads()} threads), fitted; median error "
            f"{fit['median_abs_rel_error']:.1%}"
            + (f"; not fitted on {device}: {', '.join(left_out)}" if left_out else ""),
            "tiers": "measured: a park + unpark of 1 and 32 blocks through each real tier",
            "memory_bytes": f"measured: the {device} device's memory",
            "usable_fraction": "assumption on a GPU (as h200.json's); a host's whole RAM on CPU",
            "link": "placeholder until --cluster measures the push",
        },
    }
