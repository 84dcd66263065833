"""Attention and KV-movement kernels, each a Triton kernel beside its torch reference.

The torch references (`*_ref`) are the engine's `attention_backend="torch"` path and the
oracle for the Triton kernels. Nothing here imports from the rest of pdserve. On a machine
without a GPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set before
triton is imported).

The CPU kernels in C (csrc/, compiled for this machine on first use by `cpu_native`):
`paged_decode_cpu`, the engine's `attention_backend="cpu"`; `panel_gemm_cpu`, every fp32
product of layers.Linear, on weights packed in K-major panels at load; `small_gemm_cpu`,
a decode step's few-row products where the weights are not packed so; `decode_ops_cpu`,
RMSNorm, SwiGLU's activation and RoPE. Imported as modules, not re-exported here, so
that importing `kernels` never starts a compiler.
"""

from kernels.block_copy import pack_blocks, pack_blocks_ref, unpack_blocks, unpack_blocks_ref
from kernels.kv_write import write_kv, write_kv_ref
from kernels.paged_gqa_decode import paged_gqa_decode, paged_gqa_decode_ref
from kernels.paged_mla_decode import latent_as_kv_head, paged_mla_decode, paged_mla_decode_ref
from kernels.prefill_attention import (
    prefill_attention_ref,
    prefill_attention_sdpa,
    prefill_rows,
)
from kernels.split_reduce import split_reduce, split_reduce_ref

__all__ = [
    "latent_as_kv_head",
    "pack_blocks",
    "pack_blocks_ref",
    "paged_gqa_decode",
    "paged_gqa_decode_ref",
    "paged_mla_decode",
    "paged_mla_decode_ref",
    "prefill_attention_ref",
    "prefill_attention_sdpa",
    "prefill_rows",
    "split_reduce",
    "split_reduce_ref",
    "unpack_blocks",
    "unpack_blocks_ref",
    "write_kv",
    "write_kv_ref",
]
