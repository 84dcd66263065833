"""A prefill worker in turns at shared CPUs sizes its batches by time (prefill/turns.py)."""

from __future__ import annotations

import time

import pytest
from workers import decode_worker, destination, prefill_worker

from pdserve.engine.args import EngineArgs
from pdserve.sampling_params import SamplingParams
from pdserve.serving.cpu_lease import CpuLease
from prefill.config import PrefillConfig
from prefill.turns import SMOOTHING, TurnBudget

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_one_prompt_until_measured_then_what_the_turn_buys():
    budget = TurnBudget(turn_s=0.25, cap_tokens=2048)
    assert budget.tokens() == 1  # a batch always takes one prompt: that one is measured
    budget.observe(250, 0.5)  # 2 ms a token
    assert budget.tokens() == 125
    budget.observe(100, 0.1)  # 1 ms a token: the rate moves by SMOOTHING of the gap
    rate = 0.002 + SMOOTHING * (0.001 - 0.002)
    assert budget.s_per_token == pytest.approx(rate)
    assert budget.tokens() == int(0.25 / rate)
    budget.observe(0, 1.0)  # nothing computed: nothing learned
    budget.observe(10, 0.0)
    assert budget.s_per_token == pytest.approx(rate)


def test_the_cap_and_the_floor():
    budget = TurnBudget(turn_s=10.0, cap_tokens=512)
    budget.observe(100, 0.01)  # 100 us a token: 100,000 tokens in a turn, capped
    assert budget.tokens() == 512
    slow = TurnBudget(turn_s=0.01, cap_tokens=512)
    slow.observe(10, 5.0)  # a token takes longer than the turn: still one prompt
    assert slow.tokens() == 1


@pytest.mark.parametrize(("turn_s", "cap"), [(0, 1), (-1.0, 16), (0.1, 0)])
def test_bad_settings_are_refused(turn_s, cap):
    with pytest.raises(ValueError, match="turn_s|cap_tokens"):
        TurnBudget(turn_s, cap)


def test_a_negative_turn_is_refused_by_the_config():
    with pytest.raises(ValueError, match="turn_s"):
        PrefillConfig("p", turn_s=-0.5)


def _batches(prefill) -> int:
    samples = prefill.metrics.batch_tokens.collect()[0].samples
    (count,) = (s.value for s in samples if s.name.endswith("_count"))
    return int(count)


@pytest.mark.parametrize(
    ("turn_s", "batches"),
    [(1e-9, 4), (3600.0, 2), (0.0, 2)],
    ids=["short-turns", "long-turns", "no-bound"],
)
def test_batches_under_a_lease_last_about_a_turn(tmp_path, turn_s, batches):
    """Four prompts queued behind a held lease: the first batch is one prompt (nothing
    measured yet, or the lease's first job alone); after it, a turn too short for two
    prompts makes every batch one prompt, a long one (or no bound) takes the rest at once."""
    path = str(tmp_path / "cpu")
    holder = CpuLease.open(path)
    holder.acquire()
    args = EngineArgs(block_size=16, num_kv_blocks=32, enable_prefix_caching=False)
    prefill = prefill_worker(
        "tiny-llama", f"p-turns-{turn_s}", "nixl", args, cpu_lease=path, turn_s=turn_s
    )
    decode = decode_worker("tiny-llama", f"d-turns-{turn_s}", "nixl", args)
    held = True
    try:
        prompts = [list(range(10 + 40 * i, 30 + 40 * i)) for i in range(4)]
        futures = []
        for i, prompt in enumerate(prompts):
            rid = f"r{i}"
            reserved = decode.reserve(rid, prompt, GREEDY, lease_s=60)
            futures.append(prefill.submit(rid, prompt, GREEDY, destination(decode, reserved)))
            if i == 0:  # its batch is formed and waits for the lease before the others queue
                deadline = time.monotonic() + 30
                while not holder.others_waiting():
                    assert time.monotonic() < deadline, "the prefill worker never waited"
                    time.sleep(0.005)
        holder.release()
        held = False
        for f in futures:
            f.result(60)
        assert _batches(prefill) == batches
        gauge = prefill.metrics.turn_budget_tokens.collect()[0].samples[0].value
        if turn_s == 0:
            assert prefill.turns is None and gauge == 0
        else:
            assert gauge == (1 if turn_s < 1 else args.max_num_batched_tokens)
        for i in range(4):
            decode.release(f"r{i}")
        decode.check_integrity()
    finally:
        if held:
            holder.release()
        prefill.close()
        decode.close()
        holder.close()
