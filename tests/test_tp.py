"""Tensor parallelism on CPU (gloo): TP=2 gives TP=1's greedy tokens and first-step
log-probabilities, holds half the weights per rank, parks each rank's own shard, and a rank
that dies fails the group at once (never a hang), and a killed rank 0 takes its ranks along.

Every group here is real: rank 1 is a separate process started by the engine, joined over a
TCP store on a port the OS picked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from procs import wait_gone

from pdserve import LLM, SamplingParams
from pdserve.config import ModelConfig
from pdserve.parallel.comm import RankFailed
from pdserve.parallel.shard import (
    CheckpointSharder,
    ShardRule,
    check_shardable,
    kv_head_range,
    local_config,
)
from pdserve.weights.presets import TINY_CONFIGS

LOGPROB_TOL = 1e-4
PROMPT_LENS = (1, 5, 17, 33, 64, 100)
DEADLINE_S = 60.0


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=5)


def _assert_same(ref, got) -> None:
    for i, (a, b) in enumerate(zip(ref, got)):
        assert b.token_ids == a.token_ids, f"prompt {i}: {b.token_ids} != {a.token_ids}"
        first_a, first_b = a.logprobs[0], b.logprobs[0]
        assert set(first_a) == set(first_b), f"prompt {i}: top-5 differ"
        worst = max(abs(first_a[t] - first_b[t]) for t in first_a)
        assert worst <= LOGPROB_TOL, f"prompt {i}: first-step logprob off by {worst}"


# -- the shard of a config and of a checkpoint -------------------------------------------------
def test_shard_config_names_the_dimension_that_does_not_split():
    llama = TINY_CONFIGS["tiny-llama"]  # 4 heads, 2 KV heads, MLP 128
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide num_attention"):
        check_shardable(llama, 3)
    with pytest.raises(ValueError, match="must be >= 1"):
        check_shardable(llama, 0)
    deepseek = TINY_CONFIGS["tiny-deepseek"]  # moe_intermediate_size 32
    odd = deepseek.moe.__class__(**{**deepseek.moe.__dict__, "moe_intermediate_size": 30})
    with pytest.raises(ValueError, match="moe_intermediate_size=30"):
        check_shardable(ModelConfig(**{**deepseek.__dict__, "moe": odd}), 4)
    local = local_config(llama, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    assert local.vocab_size == llama.vocab_size  # the vocabulary is cut by the embedding


def test_kv_heads_are_split_or_replicated():
    qwen = TINY_CONFIGS["tiny-qwen2"]  # 1 KV head
    assert [kv_head_range(qwen, r, 2) for r in range(2)] == [(0, 1), (0, 1)]
    llama = TINY_CONFIGS["tiny-llama"]  # 2 KV heads
    assert [kv_head_range(llama, r, 2) for r in range(2)] == [(0, 1), (1, 2)]
    assert [kv_head_range(llama, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert kv_head_range(TINY_CONFIGS["tiny-deepseek"], 1, 2) == (0, 1)  # the latent: whole


def test_sharder_cuts_exact_slices():
    llama = TINY_CONFIGS["tiny-llama"]
    rules = (
        ShardRule(".k_proj.", 0, "kv"),
        ShardRule(".o_proj.bias", 0, "first"),
        ShardRule(".o_proj.", 1),
        ShardRule("embed_tokens.", 0, "vocab"),
    )
    w = torch.arange(12.0).view(4, 3)
    rank3 = CheckpointSharder(rules, llama, rank=3, size=4)  # KV head 1 of 2
    assert torch.equal(rank3("l.k_proj.weight", w, torch.Size([2, 3])), w[2:4])
    rank1 = CheckpointSharder(rules, llama, rank=1, size=2)
    assert torch.equal(rank1("l.o_proj.weight", w.T, torch.Size([3, 2])), w.T[:, 2:4])
    bias = torch.ones(3)
    assert torch.equal(rank1("l.o_proj.bias", bias, bias.shape), torch.zeros(3))
    rank0 = CheckpointSharder(rules, llama, rank=0, size=2)
    assert torch.equal(rank0("l.o_proj.bias", bias, bias.shape), bias)
    vocab = torch.arange(5.0).view(5, 1)  # 5 rows over 2 ranks: 3 each, one padding row
    assert rank1("embed_tokens.weight", vocab, torch.Size([3, 1])).flatten().tolist() == [3, 4, 0]
    with pytest.raises(ValueError, match="'l.o_proj.weight' has shape \\(3, 5\\)"):
        rank1("l.o_proj.weight", torch.zeros(3, 5), torch.Size([3, 2]))


def test_tensor_parallel_size_is_checked_before_any_process_starts():
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide"):
        LLM("tiny-llama", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size: must be an integer"):
        LLM("tiny-llama", tensor_parallel_size=0)


# -- TP=2 against TP=1 --------------------------------------------------------------------------
MODELS = ("tiny-llama", "tiny-qwen2", "tiny-deepseek", "hf:llama", "hf:qwen2", "hf:deepseek_v2")


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name", MODELS)
def test_tp2_greedy_tokens_and_logprobs_equal_tp1(name, block_size, hf_checkpoints):
    model = str(hf_checkpoints(name[3:])[0]) if name.startswith("hf:") else name
    common = dict(block_size=block_size, num_kv_blocks=64, preemption="recompute")
    one = LLM(model, **common)
    prompts = _prompts(one.model_config.vocab_size, seed=block_size)
    ref = one.generate(prompts, _greedy())
    one.close()
    two = LLM(model, tensor_parallel_size=2, **common)
    try:
        _assert_same(ref, two.generate(prompts, _greedy()))
        two.check_integrity()
    finally:
        two.close()


def _weights(llm: LLM) -> list[int]:
    return [m.weight_bytes for m in llm.memory()]


def test_a_tp2_rank_holds_half_the_weights_and_a_pool_twice_the_blocks():
    budget = dict(kv_cache_memory=2**20, preemption="recompute")
    one = LLM("tiny-llama", **budget)
    two = LLM("tiny-llama", tensor_parallel_size=2, **budget)
    try:
        (w1,), ranks = _weights(one), two.memory()
        assert [m.rank for m in ranks] == [0, 1]
        for m in ranks:
            assert abs(m.weight_bytes / w1 - 0.5) <= 0.05 * 0.5, (m.weight_bytes, w1)
            assert m.kv_bytes == 2**20  # the same budget per rank ...
        # ... holds twice the blocks: each rank keeps half the KV heads of a block
        assert two.stats().pool.num_blocks == 2 * one.stats().pool.num_blocks
    finally:
        one.close()
        two.close()


def test_the_pool_grows_by_the_weight_memory_tp_frees():
    """Given what a rank may hold in all, its weights come first and its pool gets the rest:
    a TP=2 rank holds half the weights, so its pool grows by exactly what that frees (to the
    block), and the group holds more than twice TP=1's blocks."""
    budget = dict(memory_per_rank=8 * 2**20, preemption="recompute")
    one = LLM("tiny-llama", **budget)
    two = LLM("tiny-llama", tensor_parallel_size=2, **budget)
    try:
        (m1,), ranks = one.memory(), two.memory()
        held1 = m1.weight_bytes + m1.packed_weight_bytes
        block1 = m1.kv_bytes // m1.num_blocks
        assert m1.kv_bytes == (8 * 2**20 - held1) // block1 * block1
        for m in ranks:
            held2 = m.weight_bytes + m.packed_weight_bytes
            block2 = m.kv_bytes // m.num_blocks
            assert block2 * 2 == block1  # half the KV heads of a block
            freed = held1 - held2
            assert abs(held2 / held1 - 0.5) <= 0.05 * 0.5, (held2, held1)
            assert abs((m.kv_bytes - m1.kv_bytes) - freed) < block1, (m, m1)
        assert two.stats().pool.num_blocks > 2 * one.stats().pool.num_blocks
    finally:
        one.close()
        two.close()


def test_a_memory_budget_that_cannot_hold_the_weights_is_refused():
    with pytest.raises(ValueError, match="memory_per_rank: 1000 bytes do not cover"):
        LLM("tiny-llama", memory_per_rank=1000, preemption="recompute")
    with pytest.raises(ValueError, match="gpu_memory_utilization: needs a CUDA device"):
        LLM("tiny-llama", gpu_memory_utilization=0.9, device="cpu", preemption="recompute")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: must be in \(0, 1\]"):
        LLM("tiny-llama", gpu_memory_utilization=1.5, preemption="recompute")


def test_mla_latent_is_whole_on_every_rank():
    budget = dict(kv_cache_memory=2**20, preemption="recompute")
    one = LLM("tiny-deepseek", **budget)
    two = LLM("tiny-deepseek", tensor_parallel_size=2, **budget)
    try:
        assert two.stats().pool.num_blocks == one.stats().pool.num_blocks
    finally:
        one.close()
        two.close()


# -- preemption: every rank parks its own shard -------------------------------------------------
def test_tp2_parks_each_ranks_shard_and_resumes_exactly():
    common = dict(num_kv_blocks=10, block_size=16, preemption="tiered", admission="greedy")
    prompts = _prompts(384, seed=3)[:5]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    one = LLM("tiny-llama", **common)
    ref = one.generate(prompts, params)
    one.close()
    two = LLM("tiny-llama", tensor_parallel_size=2, **common)
    try:
        got = two.generate(prompts, params)
        stats = two.stats()
        assert stats.preemptions > 0 and stats.pool.offloaded.parks > 0, stats
        assert stats.recomputed_tokens == 0
        assert [g.token_ids for g in got] == [r.token_ids for r in ref]
        two.check_integrity()  # rank 1's tiers hold exactly rank 0's entries: none now
        assert stats.pool.used_blocks == 0 and stats.pool.offloaded.parked == 0
    finally:
        two.close()


# -- failures -----------------------------------------------------------------------------------


def test_a_dead_rank_fails_the_group_at_once():
    llm = LLM("tiny-llama", tensor_parallel_size=2, num_kv_blocks=32, preemption="recompute")
    failures = []
    group = llm.core.runner.group
    group.on_failure(failures.append)
    rank1 = group.procs[0]
    try:
        assert llm.generate([[5, 6, 7]], _greedy(2))[0].token_ids
        rank1.kill()
        deadline = time.monotonic() + DEADLINE_S
        while not failures and time.monotonic() < deadline:
            time.sleep(0.02)
        assert failures and "rank 1 exited" in str(failures[0])
        started = time.monotonic()
        with pytest.raises(RankFailed, match="rank 1"):
            llm.generate([[5, 6, 7]], _greedy(2))
        assert time.monotonic() - started < 5.0
        assert RankFailed.retryable is False
    finally:
        llm.close()
    assert rank1.poll() is not None


def test_a_frozen_rank_fails_the_group_after_its_timeout():
    llm = LLM(
        "tiny-llama",
        tensor_parallel_size=2,
        num_kv_blocks=32,
        preemption="recompute",
        tp_timeout_s=3.0,
    )
    rank1 = llm.core.runner.group.procs[0]
    try:
        assert llm.generate([[5, 6, 7]], _greedy(2))[0].token_ids
        os.kill(rank1.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RankFailed):
            llm.generate([[5, 6, 7]], _greedy(2))
        assert time.monotonic() - started < 3.0 + 10.0  # its timeout, not a hang
        assert llm.core.runner.group.failure is not None
    finally:
        os.kill(rank1.pid, signal.SIGCONT)
        llm.close()
    assert rank1.poll() is not None


def test_ranks_die_with_a_killed_rank_zero(tmp_path):
    script = textwrap.dedent(
        """
        from pdserve import LLM
        llm = LLM("tiny-llama", tensor_parallel_size=2, num_kv_blocks=16, preemption="recompute")
        print(llm.core.runner.group.procs[0].pid, flush=True)
        import time
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"rank 0 printed {line!r}"
        rank1 = int(line)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(DEADLINE_S)
        wait_gone(rank1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
