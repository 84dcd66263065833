"""A prefill worker in turns at shared CPUs sizes its batches by time (prefill/turns.py)."""

from __future__ import annotations

import time

import pytest
import torch
from workers import decode_worker, destination, drain, prefill_worker

from pdserve import LLM
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.sampling_params import SamplingParams
from pdserve.serving.cpu_lease import CpuLease, slot_turns
from prefill.config import PrefillConfig
from prefill.turns import SMOOTHING, TurnBudget
from prefill.worker import PrefillDeadline

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
NAMES = ("prefill.queue", "prefill.part", "prefill.compute")


def test_one_prompt_until_measured_then_what_the_turn_buys():
    budget = TurnBudget(turn_s=0.25, cap_tokens=2048)
    assert budget.tokens() == 1  # a batch always takes one prompt: that one is measured
    budget.observe(5, 1.0)  # the worker's first pass: one-time costs, not learned from
    assert budget.tokens() == 1 and budget.s_per_token is None
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
    budget.observe(1, 1.0)  # the first pass
    budget.observe(100, 0.01)  # 100 us a token: 100,000 tokens in a turn, capped
    assert budget.tokens() == 512
    slow = TurnBudget(turn_s=0.01, cap_tokens=512)
    slow.observe(1, 1.0)  # the first pass
    slow.observe(10, 5.0)  # a token takes longer than the turn: still one prompt
    assert slow.tokens() == 1


def test_a_lone_prompt_is_split_only_once_a_rate_is_known_and_it_does_not_fit():
    budget = TurnBudget(turn_s=0.25, cap_tokens=2048)
    assert budget.part(5000, 16) == 0  # nothing measured: the prompt goes whole
    budget.observe(1, 1.0)  # the first pass
    assert budget.part(5000, 16) == 0
    budget.observe(250, 0.5)  # 125 tokens a turn
    assert budget.part(125, 16) == 0  # the rest fits one turn: the last pass
    assert budget.part(126, 16) == 125
    assert budget.part(126, 200) == 0 and budget.part(300, 200) == 200  # a floor above it
    slow = TurnBudget(turn_s=0.001, cap_tokens=2048)
    slow.observe(1, 1.0)  # the first pass
    slow.observe(10, 1.0)  # one token is more than a turn: parts of a block
    assert slow.part(40, 16) == 16 and slow.part(16, 16) == 0


def test_a_prompt_computed_in_parts_has_the_kv_and_first_token_of_one_pass():
    args = EngineArgs(block_size=16, num_kv_blocks=16, enable_prefix_caching=False)
    prompt = list(range(7, 7 + 70))  # 5 blocks, the last one partial
    params = SamplingParams(max_tokens=1, temperature=0)
    kv, first = [], []
    for parts in ([], [16, 16, 20], [69, 5]):  # the last asks past the end: one is left
        core, _ = build_engine("tiny-llama", args)
        req = core.make_request(prompt, params, request_id="r")
        core.reserve(req)
        done = [core.prefill_part(req, n) for n in parts]
        assert sum(done) == req.num_computed_tokens <= len(prompt) - 1
        first.append(core.prefill([req])[0])
        bd = core.kv_block_dim
        kv.append([core.kv_pool.select(bd, b).clone() for b in req.block_ids])
        core.release(req)
        core.check_integrity()
        core.close()
    assert first[0] == first[1] == first[2]
    # every block, every layer, K and V; equal up to fp32 rounding (a pass of other shapes
    # may sum in another order: 4e-8 apart was seen for the 69 + 1 split, 0 for 16s)
    for blocks in kv[1:]:
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(kv[0], blocks))


def test_a_long_prompt_takes_a_turn_per_part_and_decodes_as_one_pass(tmp_path):
    """A turn too short for any prompt: the first prompt goes whole (no rate yet); then a
    70-token one goes in parts of a block (16, 16, 16, 16) and a last pass of 6 tokens,
    each in a turn of its own, and decodes to the colocated engine's tokens."""
    path = str(tmp_path / "cpu")
    args = EngineArgs(block_size=16, num_kv_blocks=32, enable_prefix_caching=False)
    prefill = prefill_worker("tiny-llama", "p-parts", "nixl", args, cpu_lease=path, turn_s=1e-9)
    decode = decode_worker("tiny-llama", "d-parts", "nixl", args)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    try:
        turns = []
        prompts = (
            ("w", list(range(5, 15))),
            ("a", list(range(3, 23))),
            ("b", list(range(30, 100))),
        )
        for rid, prompt in prompts:  # w: the first pass, not learned from
            reserved = decode.reserve(rid, prompt, params, lease_s=60)
            result = prefill.submit(rid, prompt, params, destination(decode, reserved))
            first = result.result(60).first_token
            turns.append(sum(slot_turns(path)))
            expected = LLM("tiny-llama", block_size=16).generate([prompt], params)[0]
            assert first == expected.token_ids[0]
            assert drain(decode.start(rid, first)) == (expected.token_ids, "length")
        assert turns == [1, 2, 2 + 5]
        assert _batches(prefill) == 3
        spans = {n: [s for s in result.result().spans if s.name == n] for n in NAMES}
        (queue,), (compute,) = spans["prefill.queue"], spans["prefill.compute"]
        assert len(spans["prefill.part"]) == 4  # inside the queue span, in order
        assert all(queue.start <= p.start <= p.end <= queue.end for p in spans["prefill.part"])
        assert queue.end == compute.start
        decode.check_integrity()
        prefill.check_integrity()
    finally:
        prefill.close()
        decode.close()


def test_a_deadline_that_passes_between_parts_stops_the_prompt(tmp_path):
    """The lease held past a lone prompt's deadline while its first part waits: that part
    runs, the next look at the deadline fails it (PrefillDeadline), no further turn is
    taken and every block comes back."""
    path = str(tmp_path / "cpu")
    args = EngineArgs(block_size=16, num_kv_blocks=32, enable_prefix_caching=False)
    prefill = prefill_worker("tiny-llama", "p-late", "nixl", args, cpu_lease=path, turn_s=1e-9)
    decode = decode_worker("tiny-llama", "d-late", "nixl", args)
    holder = CpuLease.open(path)
    try:
        for rid, first in (("w", list(range(5, 15))), ("a", list(range(3, 23)))):
            reserved = decode.reserve(rid, first, GREEDY, lease_s=60)
            prefill.submit(rid, first, GREEDY, destination(decode, reserved)).result(60)
            decode.release(rid)
        assert sum(slot_turns(path)) == 2  # the rate is known: the next prompt goes in parts
        long = list(range(30, 190))  # 10 parts of a block
        holder.acquire()
        reserved = decode.reserve("b", long, GREEDY, lease_s=60)
        future = prefill.submit(
            "b", long, GREEDY, destination(decode, reserved), deadline=time.monotonic() + 0.4
        )
        deadline = time.monotonic() + 30
        while not holder.others_waiting():  # its first part waits for the lease
            assert time.monotonic() < deadline, "the prefill worker never waited"
            time.sleep(0.005)
        time.sleep(0.5)  # past the prompt's deadline
        holder.release()
        with pytest.raises(PrefillDeadline):
            future.result(60)
        assert sum(slot_turns(path)) == 2 + 1 + 1  # "w", "a", the holder's, a part of "b"
        deadline = time.monotonic() + 10
        while prefill.stats().free_blocks != 32:
            assert time.monotonic() < deadline, "the prompt's blocks did not come back"
            time.sleep(0.01)
        prefill.check_integrity()
        decode.release("b")
        decode.check_integrity()
    finally:
        prefill.close()
        decode.close()
        holder.close()


def test_the_rate_is_the_pass_not_the_wait_for_its_turn(tmp_path):
    """A batch that waits half a second for the lease: the rate learned from it is its
    forward pass's (tiny-llama: well under a millisecond a token), not the wait's."""
    path = str(tmp_path / "cpu")
    holder = CpuLease.open(path)
    args = EngineArgs(block_size=16, num_kv_blocks=32, enable_prefix_caching=False)
    prefill = prefill_worker("tiny-llama", "p-rate", "nixl", args, cpu_lease=path, turn_s=10.0)
    decode = decode_worker("tiny-llama", "d-rate", "nixl", args)
    try:
        warm = list(range(5, 15))  # the first pass, not learned from
        reserved = decode.reserve("w", warm, GREEDY, lease_s=60)
        prefill.submit("w", warm, GREEDY, destination(decode, reserved)).result(60)
        decode.release("w")
        prompt = list(range(10, 30))
        holder.acquire()
        reserved = decode.reserve("r", prompt, GREEDY, lease_s=60)
        future = prefill.submit("r", prompt, GREEDY, destination(decode, reserved))
        deadline = time.monotonic() + 30
        while not holder.others_waiting():
            assert time.monotonic() < deadline, "the prefill worker never waited"
            time.sleep(0.005)
        time.sleep(0.5)  # the wait to be left out
        holder.release()
        future.result(60)
        # the wait alone would make it 0.5 s / 20 tokens = 25 ms a token; the pass is under
        # 1 ms a token here, and measured 5.4 ms on 2026-12-06 while this VM ran 1.7x slow
        assert prefill.turns.s_per_token < 0.5 * 0.5 / len(prompt)
        decode.release("r")
    finally:
        prefill.close()
        decode.close()
        holder.close()


@pytest.mark.parametrize(("turn_s", "cap"), [(0, 1), (-1.0, 16), (0.1, 0), (float("inf"), 16)])
def test_bad_settings_are_refused(turn_s, cap):
    with pytest.raises(ValueError, match="turn_s|cap_tokens"):
        TurnBudget(turn_s, cap)


@pytest.mark.parametrize("turn_s", [-0.5, float("inf"), float("nan")])
def test_a_turn_that_is_not_a_finite_number_is_refused_by_the_config(turn_s):
    with pytest.raises(ValueError, match="turn_s"):
        PrefillConfig("p", turn_s=turn_s)


def _batches(prefill) -> int:
    samples = prefill.metrics.batch_tokens.collect()[0].samples
    (count,) = (s.value for s in samples if s.name.endswith("_count"))
    return int(count)


@pytest.mark.parametrize(
    ("turn_s", "batches"),
    [(1e-9, 4), (3600.0, 3), (0.0, 2)],
    ids=["short-turns", "long-turns", "no-bound"],
)
def test_batches_under_a_lease_are_sized_by_the_turn(tmp_path, turn_s, batches):
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
