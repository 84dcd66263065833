"""Wiring one engine core from a model name and engine arguments.

    core, source = build_engine("tiny-llama", EngineArgs(num_kv_blocks=64))

Loads the weights (preset, checkpoint directory or GGUF), sizes the KV pool, builds the spill
tiers the preemption policy names (plus the host tier for `prefix_offload`), and hands the
scheduler, the KV manager and the model runner to the core. Every role builds its engine
here, so the colocated `LLM`, the prefill worker and the decode worker run the same code.
"""

from __future__ import annotations

from pdserve.attention import ATTENTION_BACKENDS
from pdserve.config import PREEMPTION
from pdserve.engine.args import EngineArgs
from pdserve.engine.core import EngineCore
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import Scheduler
from pdserve.kv import BlockAllocator, KVCache
from pdserve.kv.manager import KVManager
from pdserve.kv.offload import OffloadedKV
from pdserve.models import build_model
from pdserve.validation import RequestValidator
from pdserve.weights import ModelSource, resolve
from transfer.tiers import TIERS, Tier


def build_engine(model: str, args: EngineArgs | None = None) -> tuple[EngineCore, ModelSource]:
    args = args or EngineArgs()
    source = resolve(model)
    config = source.config
    device = args.resolve_device()
    dtype = args.resolve_dtype(device)
    scheduler_config = args.scheduler_config(config)
    backend = ATTENTION_BACKENDS[args.attention_backend](device)
    net = build_model(config, dtype, device, source.weights())
    cc = args.cache_config(config, dtype, device)
    cache = KVCache(config, cc.num_blocks, cc.block_size, dtype, device)
    tiers = _tiers(args, cache)
    kv = KVManager(
        BlockAllocator(cc.num_blocks, cc.block_size, cc.enable_prefix_caching),
        cache,
        OffloadedKV(cache, tiers) if tiers else None,
        prefix_offload=args.prefix_offload,
    )
    validator = RequestValidator(
        vocab_size=config.vocab_size,
        max_model_len=scheduler_config.max_model_len,
        tokenizer=source.tokenizer,
        pool_blocks=cc.num_blocks,
        block_size=cc.block_size,
    )
    eos = set(config.eos_token_ids)
    if source.tokenizer is not None and source.tokenizer.eos_token_id is not None:
        eos.add(source.tokenizer.eos_token_id)
    core = EngineCore(
        config,
        Scheduler(scheduler_config, kv),
        kv,
        ModelRunner(net, cache, backend, device, args.seed),
        validator,
        eos_token_ids=frozenset(eos),
    )
    return core, source


def _tiers(args: EngineArgs, cache: KVCache) -> list[Tier]:
    """The preemption policy's tiers in order; prefix offload needs at least the host one.
    Sizes in blocks: the flag, else 4x the device pool for host and CXL, 64x for disk."""
    kinds = PREEMPTION[args.preemption]
    if args.prefix_offload and not kinds:
        kinds = ("host",)
    blocks = cache.num_blocks
    block_bytes = cache.nbytes // blocks
    sizes = {
        "host": (args.spill_host_blocks, 4 * blocks),
        "cxl": (args.spill_cxl_blocks, 4 * blocks),
        "disk": (args.spill_disk_blocks, 64 * blocks),
    }
    options = {
        "host": {},
        "cxl": {
            "path": args.cxl_path,
            "bandwidth_gb_s": args.cxl_bandwidth_gb_s,
            "latency_us": args.cxl_latency_us,
        },
        "disk": {"root": args.spill_dir},
    }
    tiers = []
    for kind in kinds:
        given, default = sizes[kind]
        capacity = given if given is not None else default
        tiers.append(TIERS[kind](capacity, block_bytes, **options[kind]))
    return tiers
