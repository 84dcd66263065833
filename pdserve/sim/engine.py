"""One simulated engine: the real engine core (scheduler, KV manager, block allocator,
offloaded-KV books, validation) over a KV pool on the meta device (shapes, no memory),
accounting-only spill tiers and a cost-model runner, on its own virtual clock.

    engine = sim_engine(config, args, cost, profile, num_blocks=4096)
    engine.core.add(...); plan = engine.core.begin_step(); ...

`kv_blocks` says how many blocks fit one device of a profile: its usable memory, less its
shard of the weights, over one block's KV on that device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pdserve.config import ModelConfig
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import assemble_engine, tier_sizes
from pdserve.engine.core import EngineCore
from pdserve.kv import KVCache
from pdserve.registry import Registry
from pdserve.sim.clock import VirtualClock
from pdserve.sim.cost import CostModel
from pdserve.sim.profile import Profile
from pdserve.sim.runner import SimRunner
from pdserve.sim.shape import ModelShape
from pdserve.sim.tiers import SimTier

KV_DTYPES: Registry[torch.dtype] = Registry(
    "kv_dtype",
    {
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float32": torch.float32,
        "fp8": torch.float8_e4m3fn,
    },
)


@dataclass
class SimEngine:
    core: EngineCore
    clock: VirtualClock
    runner: SimRunner


def per_device_config(config: ModelConfig, tp: int, dp_attention: bool = False) -> ModelConfig:
    """The model as one rank of a TP group holds its KV: GQA heads split (KV heads
    replicated once tp exceeds them), MLA's one latent head whole; with dp_attention every
    head whole (a rank attends for its own requests)."""
    if tp == 1 or config.mla is not None or dp_attention:
        return config
    if config.num_heads % tp:
        raise ValueError(f"tp: {tp} does not divide the model's {config.num_heads} heads")
    kv_heads = config.num_kv_heads // tp if config.num_kv_heads >= tp else 1
    return dataclasses.replace(config, num_heads=config.num_heads // tp, num_kv_heads=kv_heads)


def kv_blocks(profile: Profile, shape: ModelShape, block_size: int) -> int:
    """Blocks of `block_size` tokens one device's memory holds after its weight shard."""
    free = profile.usable_bytes - shape.weight_bytes
    per_block = shape.kv_bytes_per_token * block_size
    if free < per_block:
        raise ValueError(
            f"tp: the model's weights ({shape.weight_bytes / 1e9:.1f} GB per device at TP="
            f"{shape.tp}{', DP attention' if shape.dp_attention else ''}) leave no room for KV "
            f"in {profile.name}'s "
            f"{profile.usable_bytes / 1e9:.1f} usable GB"
        )
    return int(free // per_block)


def sim_engine(
    config: ModelConfig,
    args: EngineArgs,
    cost: CostModel,
    profile: Profile,
    num_blocks: int,
    tp: int = 1,
    kv_dtype: str | None = None,
    dp_attention: bool = False,
) -> SimEngine:
    """`kv_dtype`: None is the profile's (the dtype the engine runs on that machine);
    `dp_attention`: the engine is one attention rank of a TP group (pdserve/sim/shape.py)."""
    dtype = KV_DTYPES[kv_dtype or profile.dtype]
    clock = VirtualClock()
    device_config = per_device_config(config, tp, dp_attention)
    cache = KVCache(device_config, num_blocks, args.block_size, dtype, torch.device("meta"))
    block_bytes = cache.nbytes // num_blocks
    tiers = []
    for kind, capacity in tier_sizes(args, num_blocks):
        if kind not in profile.tiers:
            raise ValueError(f"profile {profile.name}: tiers: no cost for the {kind!r} tier")
        tiers.append(SimTier(kind, capacity, block_bytes, profile.tiers[kind], clock))
    runner = SimRunner(cost, clock, config.vocab_size)
    core = assemble_engine(config, args, cache, tiers, runner)
    return SimEngine(core, clock, runner)
