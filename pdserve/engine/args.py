"""Engine arguments: what a user may set, resolved against the model and the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.attention import ATTENTION_BACKENDS
from pdserve.config import PREEMPTION, CacheConfig, ModelConfig, SchedulerConfig
from pdserve.failpoints import NO_FAILPOINTS, Failpoints
from pdserve.kv.kv_cache import bytes_per_block
from pdserve.registry import Registry

DTYPES: Registry[torch.dtype] = Registry(
    "dtype", {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
)
DEFAULT_CPU_KV_BYTES = 512 * 2**20
GPU_KV_FRACTION = 0.5  # of the memory left free after loading weights


@dataclass(frozen=True)
class EngineArgs:
    block_size: int = 16
    num_kv_blocks: int | None = None  # wins over kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for the KV pool (of each rank)
    # Or what a rank may hold in all, its weights first and the KV pool the rest, so a rank
    # that holds less of the model (tensor parallelism) holds more KV: memory_per_rank in
    # bytes (any device), or gpu_memory_utilization as in vLLM (CUDA: this fraction of the
    # device's total memory, less everything already in use on it once the weights loaded).
    memory_per_rank: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None  # default: the model's max positions
    dtype: str = "auto"  # float32 | float16 | bfloat16 | auto (fp32 on CPU, bf16 on CUDA)
    device: str = "auto"  # cpu | cuda | cuda:N | auto
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    attention_backend: str = "auto"  # triton on CUDA, cpu (C kernels) where they build, else torch
    # decode-only steps replayed from CUDA graphs (pdserve/engine/cuda_graphs.py); CUDA
    # only, single rank, Llama-family models; ignored elsewhere
    cuda_graphs: bool = True
    seed: int = 0
    # Preemption: recompute | swap (host tier) | tiered (host -> CXL -> disk). Tier sizes in
    # blocks; None: 4x the device pool for host and CXL, 64x for disk, each held to a share of
    # this machine (a quarter of available memory for host, an eighth for an emulated CXL
    # tier, half the spill directory's free space for disk: engine/build.py).
    preemption: str = "recompute"
    spill_host_blocks: int | None = None
    spill_cxl_blocks: int | None = None
    spill_disk_blocks: int | None = None
    spill_dir: str | None = None  # the disk tier's private directory is made under this
    cxl_path: str | None = None  # a file or DAX device backing the CXL tier; None: emulated
    # Full blocks evicted from the device prefix cache go to the spill tiers (host, and with
    # preemption="tiered" CXL then disk) with their hashes, and later prompts with the same
    # prefix reload them instead of computing them (pdserve/kv/prefix_offload.py).
    prefix_offload: bool = False
    cxl_bandwidth_gb_s: float = 32.0
    cxl_latency_us: float = 0.4
    # Ranks the model is sharded over (one process each, this one rank 0: engine/tp_engine.py)
    tensor_parallel_size: int = 1
    # A rank that does not answer a collective or a call this long fails its group (frozen)
    tp_timeout_s: float = 120.0
    # fault injection at exact states (kv.spill, kv.reload, disk.write): pdserve/failpoints.py
    failpoints: Failpoints = NO_FAILPOINTS

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r}; choose auto, {', '.join(DTYPES)}")
        ATTENTION_BACKENDS.check(self.attention_backend)
        PREEMPTION.check(self.preemption)
        if self.block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {self.block_size}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size: must be an integer >= 1, got {self.tensor_parallel_size!r}"
            )
        if not self.tp_timeout_s > 0:
            raise ValueError(f"tp_timeout_s: must be > 0, got {self.tp_timeout_s}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks: must be > 0, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory: must be > 0 bytes, got {self.kv_cache_memory}")
        if self.memory_per_rank is not None and self.memory_per_rank <= 0:
            raise ValueError(f"memory_per_rank: must be > 0 bytes, got {self.memory_per_rank}")
        util = self.gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {util}")
        if self.prefix_offload and not self.enable_prefix_caching:
            raise ValueError("prefix_offload: needs enable_prefix_caching")
        for name in ("spill_host_blocks", "spill_cxl_blocks", "spill_disk_blocks"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device: {self.device!r} is not a device") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: CUDA was asked for but is not available")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def scheduler_config(self, model: ModelConfig) -> SchedulerConfig:
        max_len = self.max_model_len or model.max_position
        if max_len > model.max_position:
            raise ValueError(
                f"max_model_len: {max_len} exceeds the model's {model.max_position} positions"
            )
        return SchedulerConfig(
            max_model_len=max_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            preemption=self.preemption,
        )

    def cache_config(
        self, model: ModelConfig, dtype: torch.dtype, device: torch.device, held_bytes: int = 0
    ) -> CacheConfig:
        """The pool of one rank; `held_bytes` is what the rank's weights (and their packed
        copies) already take, measured after loading (pdserve/engine/memory.py)."""
        num_blocks = self.num_kv_blocks
        if num_blocks is None:
            budget, field = self.kv_budget(device, held_bytes)
            num_blocks = budget // bytes_per_block(model, self.block_size, dtype)
            if num_blocks < 1:
                raise ValueError(f"{field}: {budget} bytes left for KV hold no KV block")
        return CacheConfig(self.block_size, num_blocks, self.enable_prefix_caching)

    def kv_budget(self, device: torch.device, held_bytes: int) -> tuple[int, str]:
        """Bytes for one rank's KV pool, and the argument that decided them."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory, "kv_cache_memory"
        if self.memory_per_rank is not None:
            budget = self.memory_per_rank - held_bytes
            if budget <= 0:
                raise ValueError(
                    f"memory_per_rank: {self.memory_per_rank} bytes do not cover this rank's "
                    f"{held_bytes} bytes of weights"
                )
            return budget, "memory_per_rank"
        if self.gpu_memory_utilization is not None:
            if device.type != "cuda":
                raise ValueError(
                    "gpu_memory_utilization: needs a CUDA device; on CPU give memory_per_rank "
                    "or kv_cache_memory"
                )
            free, total = torch.cuda.mem_get_info(device)
            budget = int(total * self.gpu_memory_utilization) - (total - free)
            if budget <= 0:
                raise ValueError(
                    f"gpu_memory_utilization: {self.gpu_memory_utilization} of {total} bytes "
                    f"leaves nothing for KV: {total - free} bytes are in use on {device}"
                )
            return budget, "gpu_memory_utilization"
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * GPU_KV_FRACTION), "kv_cache_memory"
        return DEFAULT_CPU_KV_BYTES, "kv_cache_memory"
