"""The KV pool tensors: one allocation for all layers, viewed per layer.

  GQA: pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; K = [:, 0], V = [:, 1]
  MLA: pool [num_layers, num_blocks, block_size, kv_lora_rank + rope_dim], rows [c_kv | k_pe]

`layers[i]` is layer i's view, handed to the attention layers.
"""

from __future__ import annotations

import torch

from pdserve.config import KVLayout, ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return config.kv_elements_per_token * block_size * itemsize


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        if config.kv_layout is KVLayout.MLA:
            shape = (config.num_layers, num_blocks, block_size, *config.kv_token_shape)
            self.block_dim = 1
        else:
            kv_heads, head_dim = config.num_kv_heads, config.head_dim
            shape = (config.num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
            self.block_dim = 2
        self.pool = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = list(self.pool.unbind(0))

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src -> dst in every layer (copy-on-write of shared blocks)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.pool.device)
        dst = torch.tensor([d for _, d in pairs], device=self.pool.device)
        self.pool.index_copy_(self.block_dim, dst, self.pool.index_select(self.block_dim, src))
