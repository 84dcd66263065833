"""How one engine step's attention is described (plain tensors) and dispatched to kernels.

The model runner packs a step's tokens as

    | decode tokens (one per sequence) | prefill chunk of seq 0 | prefill chunk of seq 1 | ... |
      <------- num_decode ----------->  <-------------- num_prefill_tokens --------------->

and describes both parts with `AttentionMetadata`. Attention layers write their new KV into
the paged pool first (slot_mapping), then read everything back through the block tables, so a
prefill chunk sees its cached prefix and itself with one code path.

Backends are chosen by name through the `ATTENTION_BACKENDS` registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import (
    latent_as_kv_head,
    paged_decode_cpu,
    paged_gqa_decode,
    paged_gqa_decode_ref,
    paged_mla_decode,
    paged_mla_decode_ref,
    prefill_attention_ref,
    prefill_attention_sdpa,
    prefill_rows,
    write_kv,
    write_kv_ref,
)
from pdserve.registry import Registry


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: pool slot of every new token, in packed order
    num_decode: int  # decode sequences (= decode tokens) at the front of the batch
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decode] int32, including the new token
    decode_max_context: int
    num_prefill_tokens: int
    prefill_query_start_loc: torch.Tensor  # [num_prefill_seqs + 1] int64, from 0
    prefill_context_lens: torch.Tensor  # [num_prefill_seqs] int32, cached prefix + chunk
    prefill_block_tables: torch.Tensor  # [num_prefill_seqs, max_blocks] int32
    prefill_max_query: int
    prefill_max_context: int
    # the same lengths on the host, one per prefill sequence (no device read to learn them)
    prefill_query_lens_host: tuple[int, ...] = ()
    prefill_context_lens_host: tuple[int, ...] = ()
    # what a backend derives from this step's metadata once for all its layers (a metadata
    # object is one step's; one reused across steps, as CUDA graphs' decode metadata is,
    # must not be given anything derived from what changes)
    _derived: dict = field(default_factory=dict, repr=False)

    def derived(self, key: str, make: Callable[[], Any]) -> Any:
        """make()'s result, computed by the first layer that asks for `key`."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]


class TorchAttentionBackend:
    """The torch reference kernels: correct everywhere, used on CPU."""

    name = "torch"
    # whether its decode step can be held by a CUDA graph: the Triton kernels skip padding
    # rows' KV (negative slots); the references neither skip them nor avoid reading device
    # values back
    graph_capturable = False
    # prefill chunks on this device type, of at most this many sequences, run SDPA per
    # sequence (prefill_attention_sdpa) instead of the reference's one padded call
    sdpa_prefill_device: str | None = None
    sdpa_prefill_max_seqs = 0

    def write_kv(self, cache: torch.Tensor, new: torch.Tensor, meta: AttentionMetadata) -> None:
        write_kv_ref(cache, new, meta.slot_mapping)

    def gqa(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [N, bs, Hkv, D]
        v_cache: torch.Tensor,  # [N, bs, Hkv, Dv]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, Dv]
        nd, np_ = meta.num_decode, meta.num_prefill_tokens
        if nd and not np_:  # one part: its output as it comes, not copied into another
            return self.decode(q, k_cache, v_cache, meta, scale)
        if np_ and not nd:
            return self.prefill(q, k_cache, v_cache, meta, scale)
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
        if nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta, scale)
        if np_:
            out[nd:] = self.prefill(q[nd:], k_cache, v_cache, meta, scale)
        return out

    def mla(
        self,
        q_latent: torch.Tensor,  # [T, H, r]
        q_pe: torch.Tensor,  # [T, H, dr]
        latent_cache: torch.Tensor,  # [N, bs, r + dr]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, r]
        nd = meta.num_decode
        rank = q_latent.shape[-1]
        out = q_latent.new_empty(q_latent.shape)
        if nd:
            out[:nd] = self.mla_decode(q_latent[:nd], q_pe[:nd], latent_cache, meta, scale)
        if meta.num_prefill_tokens:
            # Prefill in the absorbed form too: one shared KV "head" holding the latent.
            q = torch.cat([q_latent[nd:], q_pe[nd:]], dim=-1)
            k_cache, v_cache = latent_as_kv_head(latent_cache, rank)
            out[nd:] = self.prefill(q, k_cache, v_cache, meta, scale)
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_gqa_decode_ref(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            max_context_len=meta.decode_max_context,
        )

    def mla_decode(self, q_latent, q_pe, latent_cache, meta, scale: float) -> torch.Tensor:
        return paged_mla_decode_ref(
            q_latent,
            q_pe,
            latent_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            max_context_len=meta.decode_max_context,
        )

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        lens = meta.prefill_query_lens_host
        if (
            q.device.type == self.sdpa_prefill_device
            and lens
            and len(lens) <= self.sdpa_prefill_max_seqs
        ):
            return prefill_attention_sdpa(
                q,
                k_cache,
                v_cache,
                lens,
                meta.prefill_context_lens_host,
                meta.prefill_block_tables,
                scale,
            )
        return prefill_attention_ref(
            q,
            k_cache,
            v_cache,
            meta.prefill_query_start_loc,
            meta.prefill_context_lens,
            meta.prefill_block_tables,
            scale,
            max_query_len=meta.prefill_max_query,
            max_context_len=meta.prefill_max_context,
        )


# prefill sequences in one step up to which the Triton backend runs SDPA per sequence on a
# GPU; more go to the reference's one batched call. SDPA per sequence launches ~4 kernels per
# sequence and layer from Python, so many short prompts would pay more in launches than the
# reference's padded fp32 attention costs them; where the two cross is not measured (one
# 1,024- and one 2,048-token prompt were: 57 -> 28 ms of device time, 182 -> 63 ms per
# prefill, docs/gpu-h200.md), 8 is a guess to measure in the next GPU session
SDPA_PREFILL_MAX_SEQS = 8


class TritonAttentionBackend(TorchAttentionBackend):
    """Triton kernels for the decode step (paged GQA/MLA decode, KV write); prefill chunks
    on a GPU run PyTorch's SDPA per sequence in the model's dtype (FlashAttention for a
    whole prompt), elsewhere the torch reference. On CPU the Triton kernels run only under
    the Triton interpreter."""

    name = "triton"
    graph_capturable = True
    sdpa_prefill_device = "cuda"
    sdpa_prefill_max_seqs = SDPA_PREFILL_MAX_SEQS

    def write_kv(self, cache: torch.Tensor, new: torch.Tensor, meta: AttentionMetadata) -> None:
        write_kv(cache, new, meta.slot_mapping)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_gqa_decode(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            max_context_len=meta.decode_max_context,
        )

    def mla_decode(self, q_latent, q_pe, latent_cache, meta, scale: float) -> torch.Tensor:
        return paged_mla_decode(
            q_latent.contiguous(),
            q_pe.contiguous(),
            latent_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            max_context_len=meta.decode_max_context,
        )


# the longest context of a prefill sequence up to which the CPU backend runs it through the
# C decode kernel, each new token a decode row over its own context (one call for all such
# sequences of a chunk; no gathered copy, no call per sequence) instead of SDPA: on 2 vCPUs
# (AMD EPYC Zen 4, SmolLM2's heads, per layer, docs/benchmarks.md) 0.50x SDPA's time at
# 12-32 prompts of 84 tokens, 0.64x at 8 of 128, 0.87-0.90x at 256-512 tokens, 1.20x at
# 1,024 (a row's keys are read again for every query row: quadratic, where SDPA tiles)
CPU_ROW_PREFILL_MAX_CONTEXT = 512

# prefill sequences in one step up to which the CPU backend runs SDPA per sequence (no
# padding; a whole prompt as plain causal attention, which skips the masked half) instead of
# the reference's one padded, masked call. Measured per layer on 2 vCPUs (AMD EPYC Zen 4,
# SmolLM2's heads, docs/benchmarks.md): 2.0-2.1x at one prompt of 1,024-2,048 tokens,
# 1.1-1.3x for 4-64 prompts and for chunks over a cached prefix, 1.12x at 128 prompts of 16
# tokens, 0.68x at 256 of 8 (each call's overhead)
CPU_SDPA_PREFILL_MAX_SEQS = 128


class CpuAttentionBackend(TorchAttentionBackend):
    """The C decode kernels (kernels/csrc/, compiled for this CPU on first use) for fp32
    decode steps, which read each sequence's KV once where it lies instead of gathering a
    padded copy, and for the fp32 prefill sequences whose contexts are at most
    CPU_ROW_PREFILL_MAX_CONTEXT tokens (every new token a decode row); longer fp32 ones as
    SDPA per sequence (so that a sequence's results do not depend on what shares its chunk);
    other dtypes as SDPA per sequence in chunks of up to CPU_SDPA_PREFILL_MAX_SEQS sequences,
    the torch reference past them."""

    name = "cpu"
    sdpa_prefill_device = "cpu"
    sdpa_prefill_max_seqs = CPU_SDPA_PREFILL_MAX_SEQS

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        lens, contexts = meta.prefill_query_lens_host, meta.prefill_context_lens_host
        if not lens or not paged_decode_cpu.supports(q, k_cache, v_cache):
            return super().prefill(q, k_cache, v_cache, meta, scale)
        plan = meta.derived("cpu_prefill_rows", lambda: _row_plan(meta))
        tables = meta.prefill_block_tables
        if plan is None:  # only long ones, however many: each as when alone
            return prefill_attention_sdpa(q, k_cache, v_cache, lens, contexts, tables, scale)

        def rows(qr: torch.Tensor) -> torch.Tensor:
            return paged_decode_cpu.paged_gqa_decode_cpu(
                qr, k_cache, v_cache, plan.tables, plan.contexts, scale, plan.max_context
            )

        if not plan.long:
            return rows(q)
        # both kinds: each sequence takes the path it takes alone (its results do not
        # depend on what else the chunk holds)
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
        out[plan.at] = rows(q.index_select(0, plan.at))
        for i, a, b in plan.long:
            out[a:b] = prefill_attention_sdpa(
                q[a:b], k_cache, v_cache, (lens[i],), (contexts[i],), tables[i : i + 1], scale
            )
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not paged_decode_cpu.supports(q, k_cache, v_cache):
            return super().decode(q, k_cache, v_cache, meta, scale)
        return paged_decode_cpu.paged_gqa_decode_cpu(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            meta.decode_max_context,
        )

    def mla_decode(self, q_latent, q_pe, latent_cache, meta, scale: float) -> torch.Tensor:
        if not paged_decode_cpu.supports(q_latent, latent_cache, latent_cache):
            return super().mla_decode(q_latent, q_pe, latent_cache, meta, scale)
        return paged_decode_cpu.paged_mla_decode_cpu(
            q_latent,
            q_pe,
            latent_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            meta.decode_max_context,
        )


@dataclass(frozen=True)
class _RowPlan:
    """Which of a prefill chunk's tokens the CPU backend runs as decode rows, and how."""

    at: torch.Tensor | None  # the rows' places among the chunk's tokens (None: all of them)
    tables: torch.Tensor  # each row's block table row
    contexts: torch.Tensor  # each row's context
    max_context: int
    long: tuple[tuple[int, int, int], ...]  # (sequence, first token, end): through SDPA


def _row_plan(meta: AttentionMetadata) -> _RowPlan | None:
    """The sequences whose contexts are at most CPU_ROW_PREFILL_MAX_CONTEXT as decode rows;
    None when there is none."""
    lens, contexts = meta.prefill_query_lens_host, meta.prefill_context_lens_host
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    short = [i for i, c in enumerate(contexts) if c <= CPU_ROW_PREFILL_MAX_CONTEXT]
    if not short:
        return None
    rows = set(short)
    long = tuple((i, starts[i], starts[i + 1]) for i in range(len(lens)) if i not in rows)
    tables = meta.prefill_block_tables
    at = None
    if long:
        at = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in short])
        tables = tables.index_select(0, torch.tensor(short))
    row_tables, row_ctx = prefill_rows(
        tuple(lens[i] for i in short), tuple(contexts[i] for i in short), tables
    )
    return _RowPlan(at, row_tables, row_ctx, max(contexts[i] for i in short), long)


def _cpu(device: torch.device) -> CpuAttentionBackend:
    if not paged_decode_cpu.available():
        raise ValueError(
            "attention_backend 'cpu': the C decode kernel does not build here "
            "(a C compiler is needed: set CC or install gcc); use 'torch'"
        )
    return CpuAttentionBackend()


def _auto(device: torch.device) -> TorchAttentionBackend:
    """Triton on CUDA; on CPU the C decode kernels where they build, else torch."""
    if device.type == "cuda":
        return TritonAttentionBackend()
    if device.type == "cpu" and paged_decode_cpu.available():
        return CpuAttentionBackend()
    return TorchAttentionBackend()


# name -> factory(device)
ATTENTION_BACKENDS: Registry[Callable[[torch.device], TorchAttentionBackend]] = Registry(
    "attention_backend",
    {
        "auto": _auto,
        "torch": lambda device: TorchAttentionBackend(),
        "cpu": _cpu,
        "triton": lambda device: TritonAttentionBackend(),
    },
)
