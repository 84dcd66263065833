"""Preemption policies in the engine: recompute drops KV, swap/tiered park it in spill tiers
and reload it. Outputs must not change; check_integrity() after every step."""

from __future__ import annotations

import os

import pytest

from pdserve import SamplingParams
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.engine.core import EngineCore

PROMPTS = [[i + 5] * 20 for i in range(6)]
PARAMS = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


def engine(**kw) -> EngineCore:
    return build_engine("tiny-llama", EngineArgs(**kw))[0]


@pytest.fixture(scope="module")
def expected():
    return run(engine(block_size=4, num_kv_blocks=256))[0]


def run(core: EngineCore, each_step=None) -> tuple[list[list[int]], list]:
    reqs = [core.make_request(p, PARAMS) for p in PROMPTS]
    for req in reqs:
        core.add(req)
    outs = finish(core, each_step)
    ordered = [outs[r.request_id] for r in reqs]
    return [o.output_token_ids for o in ordered], ordered


def finish(core: EngineCore, each_step=None) -> dict:
    """Step until nothing is left, check_integrity() after every step -> request id -> its
    output."""
    outs = {}
    while core.has_unfinished:
        for done in core.step().finished:
            outs[done.request_id] = done
        core.check_integrity()
        if each_step is not None:
            each_step(core)
    return outs


def tight(tmp_path, **kw) -> EngineCore:
    # 26 blocks of 4 tokens: two requests' worth at their full 50 tokens
    return engine(block_size=4, num_kv_blocks=26, spill_dir=str(tmp_path), **kw)


def tier(core: EngineCore, name: str) -> dict:
    return core.stats().pool.offloaded.tiers[name]


def test_recompute_recomputes(expected, tmp_path):
    core = tight(tmp_path)
    tokens, outs = run(core)
    assert tokens == expected
    stats = core.stats()
    assert stats.preemptions == sum(o.metrics.preemptions for o in outs) > 0
    assert stats.recomputed_tokens == sum(o.metrics.recomputed_tokens for o in outs) > 0
    assert stats.pool.offloaded is None  # no tiers at all


def test_swap_parks_kv_in_host_memory_and_recomputes_nothing(expected, tmp_path):
    core = tight(tmp_path, preemption="swap")
    tokens, outs = run(core)
    assert tokens == expected
    assert sum(o.metrics.preemptions for o in outs) > 0
    assert sum(o.metrics.spills for o in outs) == sum(o.metrics.preemptions for o in outs)
    stats = core.stats()
    assert stats.recomputed_tokens == 0
    assert stats.spilled_bytes == stats.reloaded_bytes == tier(core, "host")["spilled_bytes"] > 0
    assert tier(core, "host")["used_blocks"] == 0
    assert stats.pool.used_blocks == 0
    core.close()


def test_the_longest_preempted_wait_is_counted_in_steps(expected, tmp_path):
    core = tight(tmp_path, preemption="swap")
    waits = []

    def note(c):
        s = c.scheduler
        since = [r.preempted_at_step for r in (*s.parked, *s.waiting) if r.preempted_at_step]
        assert c.longest_preempted_wait() == (s.steps - min(since) if since else 0)
        preempted = [r for r in (*s.parked, *s.waiting) if r.preempted_at_step is not None]
        assert c.preempted_waiting() == bool(preempted)
        assert all(r.preempted_at_step is None for r in s.running)
        waits.append(c.longest_preempted_wait())
        flags.append(c.preempted_waiting())

    flags = []
    tokens, _ = run(core, note)
    assert tokens == expected
    assert max(waits) > 0 and waits[-1] == 0
    assert any(flags) and not flags[-1]
    core.close()


def test_tiered_spills_down_through_cxl_and_disk(expected, tmp_path):
    # host and CXL tiers too small for everything: later victims land on disk
    core = tight(tmp_path, preemption="tiered", spill_host_blocks=6, spill_cxl_blocks=6)
    seen_tiers: set[str] = set()

    def note(c):
        seen_tiers.update(
            t for t, st in c.stats().pool.offloaded.tiers.items() if st["used_blocks"]
        )

    tokens, outs = run(core, note)
    assert tokens == expected
    assert core.stats().recomputed_tokens == 0
    assert all(tier(core, t)["used_blocks"] == 0 for t in ("host", "cxl", "disk"))
    assert tier(core, "disk")["spills"] > 0 and "disk" in seen_tiers
    spill_dir = core.kv.offload.tiers[-1].directory
    assert os.path.isdir(spill_dir)
    core.close()
    assert not os.path.exists(spill_dir)


def test_no_room_in_any_tier_falls_back_to_recompute(expected, tmp_path, caplog):
    core = tight(tmp_path, preemption="swap", spill_host_blocks=1)
    tokens, outs = run(core)
    assert tokens == expected
    assert core.stats().recomputed_tokens > 0
    assert core.stats().pool.offloaded.failed_parks > 0
    assert "will be recomputed: no tier took" in caplog.text  # the reason is in the warning
    assert "blocks do not fit (0/1 used)" in caplog.text
    core.close()


def test_a_corrupt_reload_is_recomputed_never_used(expected, tmp_path, caplog):
    core = tight(
        tmp_path, preemption="tiered", spill_host_blocks=0, spill_cxl_blocks=0
    )  # everything goes to disk
    corrupted: list[str] = []

    def corrupt_first_spill(c):
        disk = c.kv.offload.tiers[-1]
        for key, entry in list(disk._entries.items()):
            if not corrupted and entry.written.wait(5):
                with open(entry.path, "r+b") as f:
                    f.seek(-1, os.SEEK_END)
                    last = f.read(1)[0]
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([last ^ 0x55]))
                corrupted.append(key)

    tokens, outs = run(core, corrupt_first_spill)
    assert corrupted, "the test needs at least one spill"
    assert tokens == expected  # the corrupted request was recomputed, not answered wrongly
    assert core.stats().pool.offloaded.failed_reloads == 1
    assert core.stats().recomputed_tokens > 0
    assert "checksum" in caplog.text
    core.close()


def first_parked(core: EngineCore) -> str:
    """Every prompt added, stepped until one request is parked -> its id."""
    for p in PROMPTS:
        core.add(core.make_request(p, PARAMS))
    parked: tuple[str, ...] = ()
    while not parked:
        parked = core.step().parked
        core.check_integrity()
    return parked[0]


def test_abort_of_a_parked_request_drops_its_spilled_kv(tmp_path):
    core = tight(tmp_path, preemption="swap")
    victim = first_parked(core)
    assert core.kv.offload.is_parked(victim)
    done = core.abort(victim)
    assert done is not None and done.finish_reason == "abort"
    assert not core.kv.offload.is_parked(victim)
    core.check_integrity()
    finish(core)
    assert tier(core, "host")["used_blocks"] == 0
    core.close()


def test_a_parked_request_detached_for_a_move_that_fails_comes_back_parked(expected, tmp_path):
    """A migration takes a parked request out with its KV left in the tier (the books still
    balance: its KV is accounted to it); its move fails and it is parked again, then comes
    back and finishes with the same tokens."""
    core = tight(tmp_path, preemption="swap")
    victim = first_parked(core)
    request = core.detach_parked(victim)
    assert request is not None and core.holds(victim)
    assert core.detach_parked(victim) is None  # once
    blocks = core.parked_blocks(victim)
    pool, dim = core.kv_pool, core.kv_block_dim
    staged = pool.new_empty((*pool.shape[:dim], blocks, *pool.shape[dim + 1 :]))
    assert core.copy_parked(request, staged)  # the entry stays
    for _ in range(3):  # steps run without it meanwhile
        core.step()
        core.check_integrity()
    assert core.admit_detached(request) is None
    core.check_integrity()
    assert finish(core)[victim].output_token_ids == expected[int(victim)]
    assert core.stats().recomputed_tokens == 0
    assert tier(core, "host")["used_blocks"] == 0
    core.close()


@pytest.mark.parametrize("parked", [True, False])
def test_an_abort_during_a_move_ends_the_request_when_the_move_fails(tmp_path, parked):
    core = tight(tmp_path, preemption="swap")
    victim = first_parked(core)
    if not parked:  # a running one instead
        victim = next(r.request_id for r in core.scheduler.running)
    request = core.detach_parked(victim) if parked else core.detach(victim)
    assert core.abort(victim) is None and core.is_aborting(victim)
    done = core.admit_detached(request)
    assert done is not None and done.finish_reason == "abort"
    assert not core.holds(victim) and not core.kv.is_parked(victim)
    core.check_integrity()
    finish(core)
    assert core.free_blocks == core.num_blocks
    assert tier(core, "host")["used_blocks"] == 0
    core.close()


def test_a_moved_parked_request_leaves_nothing_in_the_tier(tmp_path):
    core = tight(tmp_path, preemption="swap")
    victim = first_parked(core)
    core.handed_over(core.detach_parked(victim))
    assert not core.holds(victim) and not core.kv.is_parked(victim)
    core.check_integrity()
    finish(core)
    assert tier(core, "host")["used_blocks"] == 0
    core.close()


def test_a_held_request_waits_at_its_bound_while_the_others_decode(expected):
    """A request being moved may not outgrow the destination's blocks: held at 24 tokens it
    is not scheduled past them while the rest run on; unbound, it finishes with the same
    tokens as if it had never waited."""
    core = engine(block_size=4, num_kv_blocks=256)
    reqs = [core.make_request(p, PARAMS) for p in PROMPTS]
    for req in reqs:
        core.add(req)
    core.step()  # every prompt computed
    held = reqs[2].request_id
    assert core.hold(held, 24)
    others = [r for r in reqs if r.request_id != held]
    for _ in range(12):
        core.step()
        core.check_integrity()
    assert core.kv_of(held)[1] == 24  # 20 prompt tokens, then 4 decoded, then nothing
    assert all(r.num_computed_tokens == 20 + 12 for r in others)
    assert core.hold(held, None)
    outs = finish(core)
    assert [outs[r.request_id].output_token_ids for r in reqs] == expected
    assert not core.hold(held, 30)  # finished: nothing to hold


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="preemption: unknown 'drop'; choose one of recompute"):
        EngineArgs(preemption="drop")
