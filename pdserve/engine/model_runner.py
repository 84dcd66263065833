"""Turns a scheduled batch into tensors, runs the model and samples.

Packing (see pdserve.attention): chunks of one token (decodes) first, then prefill chunks.
Block tables are padded with block 0 to the longest table of their part; padding is masked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from pdserve.attention import AttentionMetadata, TorchAttentionBackend
from pdserve.engine.batch import RunResult, ScheduledChunk
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.memory import RankMemory, rank_memory
from pdserve.engine.sampler import sample, top_logprobs
from pdserve.kv import KVCache
from pdserve.models import CausalLM


def _block_table(chunks: Sequence[ScheduledChunk], device: torch.device) -> torch.Tensor:
    width = max((len(c.block_ids) for c in chunks), default=0)
    table = np.zeros((len(chunks), max(width, 1)), dtype=np.int32)
    for i, c in enumerate(chunks):
        table[i, : len(c.block_ids)] = c.block_ids
    return torch.from_numpy(table).to(device)


class ModelRunner:
    """The real runner (see pdserve/engine/runner.py): the model's forward pass on the pool."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        backend: TorchAttentionBackend,
        device: torch.device,
        seed: int,
        cuda_graphs: bool = False,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.block_size = kv_cache.block_size
        self.generator = torch.Generator().manual_seed(seed)
        self.graphs: DecodeGraphs | None = None
        # decode-only steps from CUDA graphs: one rank's capturable model on a GPU
        graphs_ok = (
            device.type == "cuda"
            and model.graph_capturable
            and backend.graph_capturable
            and model.comm.size == 1
        )
        if cuda_graphs and graphs_ok:
            self.graphs = DecodeGraphs(model, kv_cache.layers, backend, self.block_size, device)

    def prepare(
        self, chunks: Sequence[ScheduledChunk]
    ) -> tuple[list[int], torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """-> (packed order, input_ids, positions, metadata, indices of tokens to sample)."""
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) > 1)
        decode = [chunks[i] for i in order if len(chunks[i].token_ids) == 1]
        prefill = [chunks[i] for i in order if len(chunks[i].token_ids) > 1]
        ids, positions, slots, sample_at = [], [], [], []
        bs = self.block_size
        for c in decode + prefill:
            n = len(c.token_ids)
            pos = np.arange(c.start, c.start + n)
            blocks = np.asarray(c.block_ids, dtype=np.int64)
            ids += c.token_ids
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            if c.sample:
                sample_at.append(len(ids) - 1)
        dev = self.device
        query_lens = [len(c.token_ids) for c in prefill]
        start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
        prefill_ctx = [c.start + len(c.token_ids) for c in prefill]
        decode_ctx = [c.start + 1 for c in decode]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            num_decode=len(decode),
            decode_block_tables=_block_table(decode, dev),
            decode_context_lens=torch.tensor(decode_ctx, dtype=torch.int32, device=dev),
            decode_max_context=max(decode_ctx, default=0),
            num_prefill_tokens=sum(query_lens),
            prefill_query_start_loc=torch.from_numpy(start_loc).to(dev),
            prefill_context_lens=torch.tensor(prefill_ctx, dtype=torch.int32, device=dev),
            prefill_block_tables=_block_table(prefill, dev),
            prefill_max_query=max(query_lens, default=0),
            prefill_max_context=max(prefill_ctx, default=0),
            prefill_query_lens_host=tuple(query_lens),
            prefill_context_lens_host=tuple(prefill_ctx),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        return order, input_ids, pos_t, meta, sample_at

    tp_size = 1

    def close(self) -> None:
        """Nothing to release: the pool and the model go with the runner."""

    def memory(self) -> list[RankMemory]:
        """The weights and the pool this process holds (one rank)."""
        return [rank_memory(0, self.model, self.kv_cache)]

    @torch.inference_mode()
    def execute(
        self, chunks: Sequence[ScheduledChunk], on_layer_done: Callable[[int], None] | None = None
    ) -> RunResult:
        """-> the sampled token of each sampling chunk in chunk order (and logprobs if asked)."""
        order, input_ids, positions, meta, sample_at = self.prepare(chunks)
        hidden = None
        if self.graphs is not None and self.graphs.fits(meta, on_layer_done):
            hidden = self.graphs.forward(input_ids, positions, meta)
        if hidden is None:
            hidden = self.model(
                input_ids, positions, self.kv_cache.layers, meta, self.backend, on_layer_done
            )
        if not sample_at:
            return RunResult([])
        logits = self.model.compute_logits(hidden[sample_at])  # [S, vocab], packed order
        if logits is None:
            return RunResult([])  # a tensor-parallel rank other than 0: rank 0 samples
        packed = [chunks[i] for i in order if chunks[i].sample]
        # back to the caller's chunk order
        rank = {i: r for r, i in enumerate(i for i in order if chunks[i].sample)}
        back = [rank[i] for i in range(len(chunks)) if chunks[i].sample]
        if back != list(range(len(back))):  # a row copy; `logits[back]` (advanced indexing) took
            # 2.5-12 ms for [16, 49152] on 2 CPUs, and a decode step's order is mostly kept
            logits = logits.index_select(0, torch.tensor(back, device=logits.device))
        sampling = [packed[r] for r in back]
        tokens = sample(
            logits, [c.params for c in sampling], [c.generator for c in sampling], self.generator
        )
        logprobs = None
        if any(c.params.logprobs for c in sampling):
            logprobs = [
                top_logprobs(logits[j], c.params.logprobs) if c.params.logprobs else {}
                for j, c in enumerate(sampling)
            ]
        return RunResult(tokens, logprobs)
