"""Rotation: a parked request takes a running one's turn once its slowdown (steps per token,
stalls counted) is ROTATE_RATIO times the runner's (pdserve/engine/scheduler.py). Exact steps
on a 10-block pool that holds one of two requests at its full length; outputs unchanged;
check_integrity() after every step."""

from __future__ import annotations

import pytest

from decode.config import DecodeConfig
from decode.state import DecodeState
from pdserve import SamplingParams
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.engine.core import EngineCore
from pdserve.engine.gate import make_admission

PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = {"a": [5] * 12, "b": [6] * 12}  # 3 blocks of 4 each; 36 tokens = 9 blocks at the end


def engine(blocks=10, **kw) -> EngineCore:
    args = EngineArgs(block_size=4, num_kv_blocks=blocks, enable_prefix_caching=False, **kw)
    return build_engine("tiny-llama", args)[0]


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    core = engine(blocks=64)  # room for both at their full length
    return {rid: out.output_token_ids for rid, out in run(core)[0].items()}


def run(core: EngineCore) -> tuple[dict, list[tuple]]:
    """Both requests at once, stepped to the end -> (outputs by id, per step: (step, running
    ids, parked ids, preempted, unparked))."""
    for rid, prompt in PROMPTS.items():
        core.add(core.make_request(prompt, PARAMS, request_id=rid))
    s, outs, steps = core.scheduler, {}, []
    while core.has_unfinished:
        out = core.step()
        core.check_integrity()
        outs.update((d.request_id, d) for d in out.finished)
        ids = lambda reqs: tuple(r.request_id for r in reqs)  # noqa: E731
        steps.append((s.steps, ids(s.running), ids(s.parked), out.preempted, out.unparked))
    assert core.stats().pool.used_blocks == 0
    offloaded = core.stats().pool.offloaded
    assert offloaded is None or all(t["used_blocks"] == 0 for t in offloaded.tiers.values())
    return outs, steps


def events(steps: list[tuple]) -> list[tuple]:
    """(step, preempted, unparked) of the steps where either happened."""
    return [(n, pre, unp) for n, _, _, pre, unp in steps if pre or unp]


def test_a_parked_request_takes_its_turn_at_twice_the_runners_slowdown(expected):
    core = engine(preemption="swap")
    core.rotate_by(lambda: 0.0)  # a runner may leave after one step
    outs, steps = run(core)
    assert {rid: o.output_token_ids for rid, o in outs.items()} == expected
    # step 10: both at 21 tokens (5 blocks each) and the pool full: b, the later, is parked
    # with 9 tokens generated. Its slowdown is 1 + waited/9; at step 20 it has waited 10
    # steps (2.11 > 2 x a's 1.0): a is parked (it ran since step 1) and b comes back. b
    # ends at step 33 (24 tokens), a comes back when its blocks are free.
    assert events(steps) == [(10, ("b",), ()), (20, ("a",), ("b",)), (35, (), ("a",))]
    assert core.stats().rotations == 1
    assert core.stats().recomputed_tokens == 0
    assert outs["b"].metrics.preemptions == outs["a"].metrics.preemptions == 1
    core.close()


def test_without_rotation_the_victim_waits_for_the_whole_run_ahead(expected):
    core = engine(preemption="swap")  # no policy installed: vLLM's order
    outs, steps = run(core)
    assert {rid: o.output_token_ids for rid, o in outs.items()} == expected
    # b waits from step 10 until a has generated its 24 tokens
    assert events(steps) == [(10, ("b",), ()), (25, (), ("b",))]
    assert core.stats().rotations == 0
    core.close()


def test_a_runner_keeps_its_turn_until_it_has_paid_for_its_round_trip(expected):
    # 5 steps per block held: a (5-6 blocks) may not leave before ~30 steps of running,
    # and a ends at step 24: b waits as without rotation
    core = engine(preemption="swap")
    core.rotate_by(lambda: 5.0)
    outs, steps = run(core)
    assert events(steps) == [(10, ("b",), ()), (25, (), ("b",))]
    assert {rid: o.output_token_ids for rid, o in outs.items()} == expected
    core.close()


def test_no_turn_is_bought_with_a_recompute(expected):
    # the host tier holds 8 blocks: b's 5, then not a's 6 beside them. Rotating would
    # drop a's KV to be computed again: it does not happen
    core = engine(preemption="swap", spill_host_blocks=8)
    core.rotate_by(lambda: 0.0)
    outs, steps = run(core)
    assert events(steps) == [(10, ("b",), ()), (25, (), ("b",))]
    assert core.stats().recomputed_tokens == 0
    assert {rid: o.output_token_ids for rid, o in outs.items()} == expected
    core.close()


def test_a_request_back_from_a_stall_is_the_last_to_be_a_victim():
    core = engine(preemption="swap")
    core.rotate_by(lambda: 0.0)
    s, order = core.scheduler, []
    for rid, prompt in PROMPTS.items():
        core.add(core.make_request(prompt, PARAMS, request_id=rid))
    while core.has_unfinished:
        out = core.step()
        if out.unparked:
            order.append([r.request_id for r in s.running])
    assert order[0][0] == "b"  # brought back at the front: LIFO victims come from the tail
    core.close()


@pytest.mark.parametrize(
    ("admission", "preemption", "rotates"),
    [
        ("cost-aware", "swap", True),
        ("cost-aware", "tiered", True),
        ("cost-aware", "recompute", False),  # nothing to park into
        ("kv-aware", "swap", False),
        ("greedy", "swap", False),
    ],
)
def test_the_cost_aware_policy_installs_rotation(tmp_path, admission, preemption, rotates):
    # the colocated engine's gate, and a decode worker's books
    core = engine(preemption=preemption, spill_dir=str(tmp_path))
    make_admission(admission, core)
    assert (core.scheduler.rotation is not None) is rotates
    core.close()
    core = engine(preemption=preemption, spill_dir=str(tmp_path))
    DecodeState(core, DecodeConfig("d", admission=admission))
    assert (core.scheduler.rotation is not None) is rotates
    core.close()
