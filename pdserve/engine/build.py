"""Wiring one engine core from a model name and engine arguments.

    core, source = build_engine("tiny-llama", EngineArgs(num_kv_blocks=64))

Loads the weights (preset, checkpoint directory or GGUF), sizes the KV pool, builds the spill
tiers the preemption policy names (plus the host tier for `prefix_offload`), and hands the
scheduler, the KV manager and the model runner to the core. Every role builds its engine
here, so the colocated `LLM`, the prefill worker and the decode worker run the same code;
a tensor-parallel engine too (build_tp_engine: the same pieces over a group of ranks).
"""

from __future__ import annotations

import shutil
import tempfile

import torch

from pdserve.attention import ATTENTION_BACKENDS
from pdserve.config import PREEMPTION, ModelConfig
from pdserve.engine.args import EngineArgs
from pdserve.engine.core import EngineCore
from pdserve.engine.memory import held_bytes
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.runner import Runner
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.threads import on_own_thread
from pdserve.kv import BlockAllocator, KVCache
from pdserve.kv.manager import KVManager
from pdserve.kv.offload import OffloadedKV, OffloadStore
from pdserve.models import build_model
from pdserve.tokenizer import Tokenizer
from pdserve.validation import RequestValidator
from pdserve.weights import ModelSource, resolve
from transfer.tiers import TIERS, Tier


def build_engine(model: str, args: EngineArgs | None = None) -> tuple[EngineCore, ModelSource]:
    """The engine core and where its weights came from. The building runs on a thread of
    its own that exits before this returns (pdserve/engine/threads.py): the OpenMP team it
    forms goes with it instead of competing with the team of the thread that steps."""
    args = args or EngineArgs()
    source = resolve(model)
    device = args.resolve_device()
    if device.type == "cuda" and device.index is None:
        # the current device is the caller's thread's: the build runs on another one
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = args.resolve_dtype(device)
    if args.tensor_parallel_size > 1:
        return build_tp_engine(model, source, args, device, dtype), source
    return on_own_thread(_build_single, source, args, device, dtype), source


def _build_single(source: ModelSource, args: EngineArgs, device, dtype) -> EngineCore:
    config = source.config
    backend = ATTENTION_BACKENDS[args.attention_backend](device)
    net = build_model(config, dtype, device, source.weights_on(device))
    cc = args.cache_config(config, dtype, device, held_bytes(net))
    cache = KVCache(config, cc.num_blocks, cc.block_size, dtype, device)
    runner = ModelRunner(net, cache, backend, device, args.seed, cuda_graphs=args.cuda_graphs)
    return assemble_engine(config, args, cache, tiers(args, cache), runner, source.tokenizer)


def build_tp_engine(model: str, source, args, device: torch.device, dtype: torch.dtype):
    """The engine core of a group of `args.tensor_parallel_size` ranks, this process rank 0.
    On CPU the ranks share this process's threads (each gets threads // size, at least 1)."""
    from pdserve.engine.tp_engine import TPCache, TPOffload, TPRunner
    from pdserve.engine.tp_group import START_TIMEOUT_S, TPGroup
    from pdserve.parallel.shard import check_shardable, local_config

    size = args.tensor_parallel_size
    config = source.config
    check_shardable(config, size)  # before any process starts
    threads = 0
    if device.type == "cpu":
        threads = max(1, torch.get_num_threads() // size)
        torch.set_num_threads(threads)
    # the ranks' processes are started here, on the caller's thread (they die with the
    # thread that started them); rank 0's own building on a thread that goes away, as above
    group = TPGroup(model, args, device, threads)

    def build() -> EngineCore:
        group.send_each("load", [()] * (size - 1), answered=True)  # all ranks load at once
        net = build_model(config, dtype, device, source.weights_on(device), comm=group.comm)
        local = local_config(config, size)
        own = args.cache_config(local, dtype, device, held_bytes(net)).num_blocks
        budgets = group.collect("load", START_TIMEOUT_S)
        num_blocks = min([own, *(b["num_blocks"] for b in budgets)])  # the tightest rank
        group.call("cache", num_blocks)
        cache = KVCache(local, num_blocks, args.block_size, dtype, device)
        backend = ATTENTION_BACKENDS[args.attention_backend](device)
        runner = TPRunner(ModelRunner(net, cache, backend, device, args.seed), group)
        spill = tiers(args, cache)
        offload = TPOffload(OffloadedKV(cache, spill, args.failpoints), group) if spill else None
        return assemble_engine(
            config, args, TPCache(cache, group), [], runner, source.tokenizer, offload=offload
        )

    try:
        return on_own_thread(build)
    except BaseException:
        group.close()
        raise


def assemble_engine(
    config: ModelConfig,
    args: EngineArgs,
    cache: KVCache,
    spill_tiers: list[Tier],
    runner: Runner,
    tokenizer: Tokenizer | None = None,
    offload: OffloadStore | None = None,
) -> EngineCore:
    """The engine core over a given pool, tiers and runner: the real ones (build_engine) or
    a simulator's (pdserve/sim: a pool on the meta device, accounting-only tiers, a cost
    model for a runner). Everything else is the same code either way. `offload` replaces
    the store made over `spill_tiers` (a tensor-parallel group's, over every rank's)."""
    scheduler_config = args.scheduler_config(config)
    if offload is None and spill_tiers:
        offload = OffloadedKV(cache, spill_tiers, args.failpoints)
    kv = KVManager(
        BlockAllocator(cache.num_blocks, cache.block_size, args.enable_prefix_caching),
        cache,
        offload,
        prefix_offload=args.prefix_offload,
    )
    validator = RequestValidator(
        vocab_size=config.vocab_size,
        max_model_len=scheduler_config.max_model_len,
        tokenizer=tokenizer,
        pool_blocks=cache.num_blocks,
        block_size=cache.block_size,
    )
    eos = set(config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return EngineCore(
        config,
        Scheduler(scheduler_config, kv),
        kv,
        runner,
        validator,
        eos_token_ids=frozenset(eos),
    )


def tier_sizes(args: EngineArgs, num_blocks: int) -> list[tuple[str, int]]:
    """(kind, capacity in blocks) of the preemption policy's tiers, in order; prefix offload
    needs at least the host one. Sizes: the flag, else 4x the device pool for host and CXL,
    64x for disk."""
    kinds = PREEMPTION[args.preemption]
    if args.prefix_offload and not kinds:
        kinds = ("host",)
    sizes = {
        "host": (args.spill_host_blocks, 4 * num_blocks),
        "cxl": (args.spill_cxl_blocks, 4 * num_blocks),
        "disk": (args.spill_disk_blocks, 64 * num_blocks),
    }
    return [(k, sizes[k][0] if sizes[k][0] is not None else sizes[k][1]) for k in kinds]


# The share of this machine a tier may take when its size was not given: the defaults are
# multiples of the device pool, and a GPU's pool times 4 can exceed the host's memory.
HOST_MEMORY_SHARE = 0.25  # of available memory, for the host tier
CXL_EMULATED_SHARE = 0.125  # of available memory, for an emulated CXL tier (no cxl_path)
DISK_SHARE = 0.5  # of the spill directory's free space, for the disk tier


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def bounded_tier_sizes(
    args: EngineArgs, num_blocks: int, block_bytes: int
) -> list[tuple[str, int]]:
    """tier_sizes() with each default (a size no flag gave) held to a share of what this
    machine has: available memory for host and emulated CXL, the spill directory's free
    space for disk. A given size stands as given."""
    memory = available_memory_bytes()
    out = []
    for kind, capacity in tier_sizes(args, num_blocks):
        room = None
        if getattr(args, f"spill_{kind}_blocks") is None:  # the default, not a given size
            if kind == "host" and memory is not None:
                room = int(memory * HOST_MEMORY_SHARE)
            elif kind == "cxl" and args.cxl_path is None and memory is not None:
                room = int(memory * CXL_EMULATED_SHARE)
            elif kind == "disk":
                root = args.spill_dir or tempfile.gettempdir()
                try:
                    room = int(shutil.disk_usage(root).free * DISK_SHARE)
                except OSError:
                    room = None  # the disk tier itself says what is wrong with the directory
        out.append((kind, capacity if room is None else min(capacity, room // block_bytes)))
    return out


def tiers(args: EngineArgs, cache: KVCache) -> list[Tier]:
    """The real tiers of tier_sizes(), defaults bounded by this machine (bounded_tier_sizes)."""
    block_bytes = cache.nbytes // cache.num_blocks
    options = {
        "host": {},
        "cxl": {
            "path": args.cxl_path,
            "bandwidth_gb_s": args.cxl_bandwidth_gb_s,
            "latency_us": args.cxl_latency_us,
        },
        "disk": {"root": args.spill_dir, "failpoints": args.failpoints},
    }
    return [
        TIERS[kind](capacity, block_bytes, **options[kind])
        for kind, capacity in bounded_tier_sizes(args, cache.num_blocks, block_bytes)
    ]
