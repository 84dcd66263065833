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
from pdserve.engine.scheduler import ScheduledBatch

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


def decoding(core: EngineCore, prompts: dict[str, list[int]]) -> dict:
    """Add the requests and step until each has its first token -> id -> request."""
    reqs = {rid: core.make_request(p, PARAMS, request_id=rid) for rid, p in prompts.items()}
    for req in reqs.values():
        core.add(req)
    while any(not r.num_output_tokens for r in reqs.values()):
        core.step()
    return reqs


@pytest.mark.parametrize("rotates", [True, False])
def test_a_decoding_request_back_from_a_stall_joins_the_front_of_the_batch(rotates):
    core = engine(blocks=64, preemption="swap")
    if rotates:
        core.rotate_by(lambda: 0.0)
    s = core.scheduler
    reqs = decoding(core, {"a": [5] * 12, "b": [6] * 12, "c": [7] * 12})
    for rid in ("c", "b"):  # out of the batch, their KV kept where it is (for the books)
        s.running.remove(reqs[rid])
        core.kv.free(reqs[rid].block_ids)
    c, b = reqs["c"], reqs["b"]
    c.block_ids = core.kv.allocate_fresh(core.kv.blocks_needed(c.num_computed_tokens))
    c.preempted_at_step = s.steps - 3
    s.admit_running(c)  # decoding: only its next token to compute
    assert c.stalled_steps == 3 and c.running_since == s.steps
    b.block_ids = core.kv.allocate_fresh(core.kv.blocks_needed(b.num_tokens))
    b.num_computed_tokens = 0  # dropped: to be computed again, prompt and all
    b.preempted_at_step = s.steps
    s.admit_running(b)
    ids = [r.request_id for r in s.running]
    # rotating: c first (the last victim), b still to prefill at the end; without: the end
    assert ids == (["c", "a", "b"] if rotates else ["a", "c", "b"])
    core.close()


def test_an_owed_request_that_fits_comes_back_before_an_older_one_that_does_not():
    core = engine(blocks=64, preemption="swap")
    core.rotate_by(lambda: 0.0)
    s = core.scheduler
    reqs = decoding(core, {"a": [5] * 12, "big": [6] * 120, "c": [7] * 12})
    for rid in ("big", "c"):  # big parked first, then c
        s.running.remove(reqs[rid])
        s._preempt(reqs[rid], ScheduledBatch())
    assert [r.request_id for r in s.parked] == ["big", "c"]
    hold = core.kv.allocate_fresh(core.kv.num_free_blocks - 8)  # room for c (4), not big (31)
    reqs["c"].preempted_at_step = s.steps - 10  # 10 steps for its 1 token: slowdown 11
    out = core.step()
    assert out.unparked == ("c",)
    assert [r.request_id for r in s.parked] == ["big"]
    core.kv.free(hold)
    finish = {}
    while core.has_unfinished:
        finish.update((d.request_id, d) for d in core.step().finished)
        core.check_integrity()
    assert set(finish) == {"a", "big", "c"}
    core.close()


def test_the_tiers_take_a_park_whole_in_the_first_tier_with_room(tmp_path):
    core = engine(
        preemption="tiered",
        spill_dir=str(tmp_path),
        spill_host_blocks=5,
        spill_cxl_blocks=10,
        spill_disk_blocks=0,
    )
    kv = core.kv
    assert kv.tiers_take([5, 10])
    assert kv.tiers_take([6])  # not in host: whole in CXL
    assert not kv.tiers_take([6, 6])  # 5 + 4 left: neither takes the second whole
    assert not kv.tiers_take([11])
    assert kv.tiers_take([])
    core.close()
    assert not engine(preemption="recompute").kv.tiers_take([1])  # no tiers at all


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
