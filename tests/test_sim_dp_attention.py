"""DP attention in the simulator: a TP group whose ranks attend data-parallel, each for its
own requests with their whole KV, the MLP split over the group (how MLA models are served:
their latent does not split under TP, so plain TP holds one copy of every request's KV on
every rank)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.workload import specs_of
from pdserve.engine.args import EngineArgs
from pdserve.sim.cost import RooflineCost
from pdserve.sim.engine import kv_blocks
from pdserve.sim.plan import layouts
from pdserve.sim.profile import load_profile
from pdserve.sim.run import Setup, Topology, simulate
from pdserve.sim.shape import ModelShape
from pdserve.weights import model_config

DEEPSEEK = "pdserve/sim/configs/deepseek-v3.json"
QWEN = "pdserve/sim/configs/qwen2.5-32b.json"
ROOT = Path(__file__).parent.parent


def test_a_rank_holds_the_attention_whole_and_the_group_eight_times_the_requests():
    config, h200 = model_config(DEEPSEEK), load_profile("h200")
    tp = ModelShape.of(config, 1, 2, tp=8)  # FP8 weights, bf16 latent
    dp = ModelShape.of(config, 1, 2, tp=8, dp_attention=True)
    per_token = 61 * (512 + 64) * 2  # the whole latent and rope key, every layer, bf16
    assert tp.kv_bytes_per_token == dp.kv_bytes_per_token == per_token == 70_272
    # every rank holds the attention layers and the input embedding whole: 7/8 of them more
    # than its TP shard (1 byte a parameter in FP8)
    whole = dp.attention_params + 129_280 * 7_168
    assert dp.weight_bytes - tp.weight_bytes == pytest.approx(whole * 7 / 8, abs=2)
    blocks_tp, blocks_dp = kv_blocks(h200, tp, 16), kv_blocks(h200, dp, 16)
    for shape, blocks in ((tp, blocks_tp), (dp, blocks_dp)):
        free = h200.memory_bytes * 0.9 - 4e9 - shape.weight_bytes
        assert blocks == int(free // (per_token * 16))
    # plain TP: one pool's worth of requests for the group (the latent on every rank);
    # DP attention: each rank its own pool's worth, a little smaller per rank
    assert blocks_dp < blocks_tp and 8 * blocks_dp > 6 * blocks_tp


def test_gqa_ranks_keep_every_head_and_the_mlp_sees_the_groups_tokens():
    config = model_config(QWEN)
    whole = ModelShape.of(config, 2, 2, tp=1)
    dp = ModelShape.of(config, 2, 2, tp=4, dp_attention=True)
    assert dp.kv_bytes_per_token == whole.kv_bytes_per_token  # 8 KV heads, none split
    assert dp.attn_flops_per_context_token == whole.attn_flops_per_context_token
    assert dp.flops_per_token == whole.flops_per_token  # own tokens' attention + 4 x 1/4 MLP
    moe = model_config(DEEPSEEK)
    tp8 = ModelShape.of(moe, 1, 2, tp=8)
    dp8 = ModelShape.of(moe, 1, 2, tp=8, dp_attention=True)
    # the experts a step touches are those of the whole group's tokens: a rank's 12 tokens
    # read what a TP rank's 96 do, plus the other 7/8 of the weights it holds whole
    extra = (dp8.attention_params + dp8.embedding_params) * 7 / 8
    assert dp8.weight_bytes_read(12) == pytest.approx(tp8.weight_bytes_read(96) + extra)
    # MLA: a rank scores its own tokens with all 128 heads, a TP rank with 16
    assert dp8.attn_flops_per_context_token == 8 * tp8.attn_flops_per_context_token
    h200 = load_profile("h200")
    cost_dp = RooflineCost(h200, dp8, fp8_weights=True)
    # an all-gather and a reduce-scatter per layer, each (k-1)/k of the group's 96 tokens'
    # hidden states in bf16: one all-reduce's bytes between them, two latencies
    moved = 2 * 7 / 8 * 96 * 7168 * 2 / h200.interconnect_bytes_s
    expected = 61 * (2 * h200.allreduce_latency_s + moved)
    assert cost_dp.allreduce_seconds(12) == pytest.approx(expected)


def test_a_dp_attention_group_serves_every_request_on_all_its_ranks():
    config = model_config(DEEPSEEK)
    args = EngineArgs(block_size=16, num_kv_blocks=80, max_model_len=4096)
    setup = Setup(config, load_profile("h200"), Topology(tp=8, dp_attention=True), args, 1)
    specs = specs_of("reasoning", 48, seed=2, mean_output=60, max_output=120)
    point = simulate(setup, "greedy+recompute", specs, concurrency=32, label="")
    assert point["errors"] == 0
    assert point["generated_tokens"] == sum(s.output_tokens for s in specs)
    ranks = {f"replica-0.{r}" for r in range(8)}
    assert set(point["per_worker"]) == ranks
    assert all(w["requests"] > 0 for w in point["per_worker"].values())


def test_one_rank_of_a_balanced_group_stands_for_the_group():
    """A study may simulate one rank with 1/k of the clients (the cost already assumes the
    other ranks as loaded): its figures are the group's within the routing's noise."""
    config = model_config(DEEPSEEK)
    args = EngineArgs(block_size=16, num_kv_blocks=80, max_model_len=4096)
    whole = Topology(tp=8, dp_attention=True)
    one = Topology(tp=8, dp_attention=True, attention_ranks=1)
    assert (whole.engines, one.engines) == (8, 1)
    assert one.describe() == "DP=1, TP=8, DP attention (1 of its 8 ranks simulated)"
    points = {}
    for topo, clients, n in ((whole, 32, 96), (one, 4, 12)):
        setup = Setup(config, load_profile("h200"), topo, args, 1)
        specs = specs_of("reasoning", n, seed=2, mean_output=60, max_output=120)
        points[topo.engines] = simulate(setup, "greedy+recompute", specs, clients, label="")
    assert set(points[1]["per_worker"]) == {"replica-0.0"}
    group, rank = points[8], points[1]
    assert rank["tpot_p50_s"] == pytest.approx(group["tpot_p50_s"], rel=0.15)
    assert 8 * rank["throughput_tok_s"] == pytest.approx(group["throughput_tok_s"], rel=0.25)


def test_dp_attention_refuses_what_it_cannot_simulate():
    config = model_config(DEEPSEEK)
    with pytest.raises(ValueError, match="dp_attention: needs tensor parallelism"):
        Topology(tp=1, dp_attention=True)
    with pytest.raises(ValueError, match="dp_attention: simulated for colocated replicas"):
        Topology(tp=2, prefill=1, decode=1, dp_attention=True)
    for ranks, dp_attention in ((0, True), (9, True), (1, False)):
        with pytest.raises(ValueError, match="attention_ranks: 1 to tp"):
            Topology(tp=8, dp_attention=dp_attention, attention_ranks=ranks)
    fitted = load_profile(str(ROOT / "docs/results/cpu-profile-smollm2-2026-12-05-2d.json"))
    with pytest.raises(ValueError, match="DP attention is costed from a roofline profile"):
        Setup(config, fitted, Topology(tp=2, dp_attention=True), EngineArgs(num_kv_blocks=8))
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "sim", "--model", DEEPSEEK, "--dp-attention",
         "--concurrency", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "dp_attention: needs tensor parallelism" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_planner_offers_dp_attention_for_mla_models_only():
    h200 = load_profile("h200")
    mla = layouts(model_config(DEEPSEEK), h200, 8, 1)
    assert Topology(dp=1, tp=8, dp_attention=True) in mla
    assert not any(t.dp_attention for t in layouts(model_config(QWEN), h200, 8, 2))
