"""Decode steps through CUDA graphs (pdserve/engine/cuda_graphs.py).

On CPU there are no graphs: `capture=False` runs the same padded, bucketed forward eagerly,
which checks everything but the capture itself — the padding rows write no KV and change
no real row, the buckets and widths are chosen as documented, and a whole generation gives
the eager engine's tokens. The `gpu` tests capture and replay for real.
"""

from __future__ import annotations

import pytest
import torch

from kernels import write_kv_ref
from pdserve import LLM, SamplingParams
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.cuda_graphs import BATCH_BUCKETS, DecodeGraphs, warm_up_graphs, width_bucket

PROMPTS = ["The capital of France is", "1 2 3 4 5", "Once upon a time", "a b"]


def _skipping_padding(backend):
    """The runner's CPU backend writing KV as the Triton kernel does: a padding row's
    negative slot is skipped (the references take real slots only; on a GPU the graphs run
    the Triton backend, whose skip tests/test_kernels_triton.py test_write_kv checks)."""

    class SkippingPadding(type(backend)):
        def write_kv(self, cache, new, meta):
            real = meta.slot_mapping >= 0
            write_kv_ref(cache, new[real], meta.slot_mapping[real])

    return SkippingPadding()


def _graphs(llm: LLM, capture: bool) -> DecodeGraphs:
    runner = llm.core.runner
    return DecodeGraphs(
        runner.model,
        runner.kv_cache.layers,
        _skipping_padding(runner.backend),
        runner.block_size,
        runner.device,
        capture=capture,
    )


def _tokens(llm: LLM, n: int = 40) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def _decode_chunks(contexts, spacing: int) -> list[ScheduledChunk]:
    """One decode per context (16-token blocks), sequence i's blocks from 1 + spacing * i."""
    return [
        ScheduledChunk(
            token_ids=[7 + i],
            start=ctx - 1,
            block_ids=list(range(1 + spacing * i, 1 + spacing * i + -(-ctx // 16))),
            sample=True,
            params=SamplingParams(temperature=0),
            generator=None,
        )
        for i, ctx in enumerate(contexts)
    ]


def test_buckets_and_widths():
    assert BATCH_BUCKETS[:4] == (1, 2, 4, 8) and BATCH_BUCKETS[-1] == 256
    assert all(b / a <= 1.5 for a, b in zip(BATCH_BUCKETS[3:], BATCH_BUCKETS[4:]))
    assert [width_bucket(n) for n in (1, 4, 5, 8, 9, 300)] == [4, 4, 8, 8, 16, 512]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_padded_forward_matches_eager_and_writes_only_real_slots(backend):
    from kernels import paged_decode_cpu

    if backend == "cpu" and not paged_decode_cpu.available():
        pytest.skip("the C decode kernels do not build here")
    llm = LLM("tiny-llama", num_kv_blocks=64, block_size=16, attention_backend=backend)
    runner = llm.core.runner
    graphs = _graphs(llm, capture=False)
    contexts = (5, 17, 40)  # 3 sequences: bucket 4, widths 1..3 blocks -> width 4
    chunks = _decode_chunks(contexts, spacing=4)
    pool = runner.kv_cache.pool
    pool.normal_(generator=torch.Generator().manual_seed(0))
    before = pool.clone()
    _, ids, pos, meta, _ = runner.prepare(chunks)
    assert graphs.fits(meta, None) and not graphs.fits(meta, lambda i: None)
    padded = graphs.forward(ids, pos, meta)
    after_graph = pool.clone()
    pool.copy_(before)
    eager = runner.model(ids, pos, runner.kv_cache.layers, meta, runner.backend)
    assert padded.shape == eager.shape == (3, llm.model_config.hidden_size)
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    # the padded step wrote what the eager one did (to rounding: its GEMMs have 4 rows, not
    # 3) into the 3 real slots, and nothing else
    torch.testing.assert_close(after_graph, pool, atol=1e-5, rtol=1e-5)
    changed = (after_graph != before).any(dim=-1).any(dim=-1)  # [L, 2, blocks, bs]
    slots = {(b, o) for _, _, b, o in changed.nonzero().tolist()}
    assert slots == {(c.block_ids[c.start // 16], c.start % 16) for c in chunks}
    assert set(graphs._graphs) == {(4, 4)}


def test_generation_through_graph_path_equals_eager():
    eager = LLM("tiny-llama", num_kv_blocks=64, block_size=16)
    expected = _tokens(eager)
    eager.close()
    llm = LLM("tiny-llama", num_kv_blocks=64, block_size=16)
    llm.core.runner.graphs = graphs = _graphs(llm, capture=False)
    assert _tokens(llm) == expected
    # 4 sequences (bucket 4) whose tables grew from 1 to 4 blocks (width 4); after some
    # finish, smaller buckets
    assert (4, 4) in graphs._graphs
    llm.check_integrity()
    llm.close()


def test_warm_up_captures_every_shape_a_run_can_meet():
    llm = LLM("tiny-llama", num_kv_blocks=64, block_size=16)
    graphs = _graphs(llm, capture=False)
    assert graphs.warm_up(max_batch=5, max_blocks=20) == 16
    assert set(graphs._graphs) == {(b, w) for b in (1, 2, 4, 8) for w in (4, 8, 16, 32)}
    assert graphs.warm_up(max_batch=5, max_blocks=20) == 0  # nothing new
    llm.close()


def test_runner_uses_graphs_only_on_cuda():
    llm = LLM("tiny-llama", num_kv_blocks=16)
    assert llm.core.runner.graphs is None  # CPU: nothing to capture
    llm.close()


@pytest.mark.gpu
def test_gpu_graph_replay_gives_the_eager_tokens():
    # fp32: the graph's kernels see the width bucket as the longest context (another
    # split-KV choice than eager, so another summation order); in fp32 that cannot flip a
    # greedy token the way bf16 rounding could
    kw = dict(num_kv_blocks=256, device="cuda", dtype="float32")
    eager = LLM("tiny-llama", cuda_graphs=False, **kw)
    expected = _tokens(eager, 64)
    eager.close()
    llm = LLM("tiny-llama", **kw)
    graphs = llm.core.runner.graphs
    assert graphs is not None
    pool = llm.core.runner.kv_cache.pool
    pool.normal_()
    before = pool.clone()
    assert warm_up_graphs(llm.core, 4, 8) == 3 * 2  # buckets 1, 2, 4 x widths 4, 8
    assert torch.equal(pool, before)  # the padding rows wrote nothing
    assert _tokens(llm, 64) == expected  # 4 sequences of up to ~6 blocks
    stats = graphs.stats()
    assert stats["failed"] is None and stats["replays"] > 0 and stats["graphs"] >= 6, stats
    llm.check_integrity()
    llm.close()


@pytest.mark.gpu
def test_gpu_captured_padded_step_matches_eager_in_bf16():
    llm = LLM("tiny-llama", num_kv_blocks=256, device="cuda", dtype="bfloat16")
    runner = llm.core.runner
    graphs = runner.graphs
    contexts = (5, 17, 40, 300, 1)  # 5 sequences: bucket 8, width 32
    chunks = _decode_chunks(contexts, spacing=20)
    runner.kv_cache.pool.normal_()
    _, ids, pos, meta, _ = runner.prepare(chunks)
    for _ in range(3):  # the capture, then replays
        replayed = graphs.forward(ids, pos, meta).clone()
    eager = runner.model(ids, pos, runner.kv_cache.layers, meta, runner.backend)
    torch.testing.assert_close(replayed, eager, atol=3e-2, rtol=3e-2)
    assert graphs.stats()["replays"] == 3 and set(graphs._graphs) == {(8, 32)}
    llm.close()
