"""CUDA graphs of the decode-only step: the model's forward pass captured once per batch
size bucket and table width bucket, then replayed with the step's inputs copied into the
graph's own buffers.

Why: on one H200 our eager decode step of a Llama-3-8B-shaped model took 25–30 ms at every
batch below 128 against a 3.7 ms memory floor at batch 1 (docs/gpu-h200.md): ~20 kernel
launches per layer, each behind a few tens of microseconds of Python. A replayed graph
launches the same kernels without the Python.

What is captured: embedding -> layers (KV write, paged decode attention, projections) ->
final norm, for `bucket` sequences whose block tables are at most `width` blocks wide. The
logits and the sampling stay outside (they run on the real rows only). A step goes through
a graph only when every chunk is a decode (one new token), nobody asked for per-layer
callbacks (the prefill side's layer-wise push) and the batch fits the largest bucket;
anything else runs eagerly, as does everything on CPU.

Padding rows (bucket - batch of them): token 0 at position 0, context length 0 (the
decode kernels read nothing and write zeros for them), slot -1 (the KV write skips it:
kernels/kv_write.py), so they never touch the pool. Their hidden states are discarded.

The kernels see `max_context_len = width * block_size` (a graph cannot depend on the
step's longest context): the split-KV choice is made for the width, and the programs of
splits past a sequence's end return at once.

Graphs are captured at first use: a step that meets a new (bucket, width) pays an eager
forward and a capture (tens of milliseconds). `warm_up_graphs(core, max_batch, max_blocks)`
captures every shape a run can meet up front (benchmarks that time steps call it).

`capture=False` runs the same padded, bucketed forward without capturing (the tests' way
to check the padding on CPU, where there are no graphs).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.attention import AttentionMetadata, TorchAttentionBackend
from pdserve.models import CausalLM

if TYPE_CHECKING:
    from pdserve.engine.core import EngineCore

log = logging.getLogger(__name__)

# batch sizes a graph is captured for (a step runs in the smallest that holds it): powers of
# two to 8, then steps of at most half the bucket below (at most a third of a bucket's rows
# are padding past batch 8: 65 sequences run as 96)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def width_bucket(blocks: int) -> int:
    """Block-table widths a graph is captured for: powers of two (at least 4)."""
    return max(4, 1 << max(0, blocks - 1).bit_length())


class _Graph:
    """One captured forward: its input buffers, its output, and the graph (None: eager)."""

    def __init__(self, bucket: int, width: int, block_size: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(bucket, dtype=torch.long)
        self.positions = zeros(bucket, dtype=torch.long)
        self.slots = torch.full((bucket,), -1, dtype=torch.long, device=device)
        self.tables = zeros(bucket, width, dtype=torch.int32)
        self.context_lens = zeros(bucket, dtype=torch.int32)
        empty_i64 = zeros(1, dtype=torch.long)
        empty_i32 = zeros(0, dtype=torch.int32)
        self.meta = AttentionMetadata(
            slot_mapping=self.slots,
            num_decode=bucket,
            decode_block_tables=self.tables,
            decode_context_lens=self.context_lens,
            decode_max_context=width * block_size,
            num_prefill_tokens=0,
            prefill_query_start_loc=empty_i64,
            prefill_context_lens=empty_i32,
            prefill_block_tables=zeros(0, 1, dtype=torch.int32),
            prefill_max_query=0,
            prefill_max_context=0,
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None

    def load(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """The step's rows into the buffers; the rest become padding."""
        n, w = input_ids.shape[0], meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:].zero_()
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:].fill_(-1)
        self.tables[:n, :w].copy_(meta.decode_block_tables)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.context_lens[n:].zero_()


class DecodeGraphs:
    """The captured decode graphs of one model runner (see the module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        kv_layers: list[torch.Tensor],
        backend: TorchAttentionBackend,
        block_size: int,
        device: torch.device,
        max_batch: int = 256,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.capture = capture
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None  # the graphs share one memory pool (one replays at a time)
        self.failed: str | None = None  # why capturing stopped (then every step is eager)
        self.replays = 0

    def fits(self, meta: AttentionMetadata, on_layer_done: Callable | None) -> bool:
        """Whether this step can run from a graph: decodes only, no per-layer callbacks, a
        batch within the largest bucket, and capturing has not failed."""
        if self.failed or on_layer_done is not None or meta.num_prefill_tokens:
            return False
        return 0 < meta.num_decode <= self.buckets[-1]

    @torch.inference_mode()  # the buffers may be inference tensors (made by warm_up)
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Hidden states [num_decode, hidden] of a decode-only step, or None when its graph
        could not be captured (the caller runs the step eagerly; capturing stops)."""
        n = meta.num_decode
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        width = width_bucket(meta.decode_block_tables.shape[1])
        g = self._graphs.get((bucket, width))
        if g is None:
            g = _Graph(bucket, width, self.block_size, self.device)
            g.load(input_ids, positions, meta)
            if not self._capture(g):
                return None
            self._graphs[(bucket, width)] = g
        else:
            g.load(input_ids, positions, meta)
        if g.graph is not None:
            g.graph.replay()
            self.replays += 1
        else:
            g.hidden = self._run(g)
        return g.hidden[:n]

    @torch.inference_mode()  # as the engine's steps run (ModelRunner.execute)
    def warm_up(self, max_batch: int, max_blocks: int) -> int:
        """Capture every (bucket, width) a step of at most `max_batch` sequences of at most
        `max_blocks` blocks each can meet (all rows padding: nothing is written). -> graphs
        captured now."""
        top = self.buckets[bisect.bisect_left(self.buckets, min(max_batch, self.buckets[-1]))]
        widths, w = [], 4
        while w <= width_bucket(max_blocks):
            widths.append(w)
            w *= 2
        done = 0
        for bucket in (b for b in self.buckets if b <= top):
            for width in widths:
                if (bucket, width) in self._graphs or self.failed:
                    continue
                g = _Graph(bucket, width, self.block_size, self.device)
                if not self._capture(g):
                    return done
                self._graphs[(bucket, width)] = g
                done += 1
        return done

    def _run(self, g: _Graph) -> torch.Tensor:
        return self.model(g.input_ids, g.positions, self.kv_layers, g.meta, self.backend)

    def _capture(self, g: _Graph) -> bool:
        if not self.capture:
            return True
        stream = torch.cuda.current_stream(self.device)
        try:
            # warm-up off the capture: the kernels' first launches compile and autotune,
            # and cuBLAS picks its workspace (neither may happen inside a capture)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._run(g)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA work (a spill, a transfer) during the
            # capture is not an error
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                g.hidden = self._run(g)
            self._pool = graph.pool()
            g.graph = graph
            return True
        except Exception as e:  # a step that cannot be captured: eager from now on
            # a capture that fails to end leaves its side stream current: back to ours
            torch.cuda.set_stream(stream)
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("CUDA graph capture failed, decode steps run eagerly: %s", self.failed)
            self._graphs.clear()
            return False

    def stats(self) -> dict:
        return {
            "graphs": len(self._graphs),
            "replays": self.replays,
            "failed": self.failed,
        }


def warm_up_graphs(core: EngineCore, max_batch: int, max_blocks: int) -> int:
    """Capture up front the decode graphs a run of `core` can meet (nothing where the engine
    has no graphs: CPU, TP ranks, eager models). -> graphs captured."""
    graphs = getattr(core.runner, "graphs", None)
    return graphs.warm_up(max_batch, max_blocks) if graphs is not None else 0
