"""Attention and KV-movement kernels, each beside its torch reference.

The torch references here are the engine's `attention_backend="torch"` path (CPU and CUDA);
Triton kernels join them one file per kernel. Nothing here imports from the rest of pdserve.
"""

from kernels.kv_write import write_kv_ref
from kernels.paged_gqa_decode import paged_gqa_decode_ref
from kernels.paged_mla_decode import paged_mla_decode_ref
from kernels.prefill_attention import prefill_attention_ref

__all__ = [
    "paged_gqa_decode_ref",
    "paged_mla_decode_ref",
    "prefill_attention_ref",
    "write_kv_ref",
]
