"""Preemption policies in the engine: recompute drops KV, swap/tiered park it in spill tiers
and reload it. Outputs must not change; check_integrity() after every step."""

from __future__ import annotations

import os

import pytest

from pdserve import SamplingParams
from pdserve.engine.args import EngineArgs
from pdserve.engine.llm_engine import LLMEngine

PROMPTS = [[i + 5] * 20 for i in range(6)]
PARAMS = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected():
    roomy = LLMEngine("tiny-llama", EngineArgs(block_size=4, num_kv_blocks=256))
    return run(roomy)[0]


def run(engine: LLMEngine, each_step=None) -> tuple[list[list[int]], list]:
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        engine.check_integrity()
        if each_step is not None:
            each_step(engine)
    ordered = [outs[i] for i in ids]
    return [o.token_ids for o in ordered], ordered


def tight(tmp_path, **kw) -> LLMEngine:
    # 26 blocks of 4 tokens: two requests' worth at their full 50 tokens
    return LLMEngine(
        "tiny-llama",
        EngineArgs(block_size=4, num_kv_blocks=26, spill_dir=str(tmp_path), **kw),
    )


def test_recompute_recomputes(expected, tmp_path):
    engine = tight(tmp_path)
    tokens, outs = run(engine)
    assert tokens == expected
    assert sum(o.metrics.preemptions for o in outs) > 0
    assert engine.scheduler.recomputed_tokens == sum(o.metrics.recomputed_tokens for o in outs) > 0
    assert engine.spiller is None


def test_swap_parks_kv_in_host_memory_and_recomputes_nothing(expected, tmp_path):
    engine = tight(tmp_path, preemption="swap")
    tokens, outs = run(engine)
    assert tokens == expected
    assert sum(o.metrics.preemptions for o in outs) > 0
    assert sum(o.metrics.spills for o in outs) == sum(o.metrics.preemptions for o in outs)
    assert engine.scheduler.recomputed_tokens == 0
    stats = engine.spiller.store.stats()["host"]
    assert stats["spilled_bytes"] == stats["reloaded_bytes"] > 0
    assert stats["used_blocks"] == 0
    assert engine.allocator.num_used_blocks == 0
    engine.close()


def test_tiered_spills_down_through_cxl_and_disk(expected, tmp_path):
    # host and CXL tiers too small for everything: later victims land on disk
    engine = tight(tmp_path, preemption="tiered", spill_host_blocks=6, spill_cxl_blocks=6)
    seen_tiers: set[str] = set()

    def note(e):
        seen_tiers.update(t.name for t in e.spiller.store.where.values())

    tokens, outs = run(engine, note)
    assert tokens == expected
    assert engine.scheduler.recomputed_tokens == 0
    stats = engine.spiller.store.stats()
    assert all(stats[t]["used_blocks"] == 0 for t in ("host", "cxl", "disk"))
    assert stats["disk"]["spills"] > 0 and "disk" in seen_tiers
    spill_dir = engine.spiller.store.tiers[-1].directory
    assert os.path.isdir(spill_dir)
    engine.close()
    assert not os.path.exists(spill_dir)


def test_no_room_in_any_tier_falls_back_to_recompute(expected, tmp_path, caplog):
    engine = tight(tmp_path, preemption="swap", spill_host_blocks=1)
    tokens, outs = run(engine)
    assert tokens == expected
    assert engine.scheduler.recomputed_tokens > 0
    assert engine.spiller.failed_spills > 0
    assert "will be recomputed: no tier took" in caplog.text  # the reason is in the warning
    assert "blocks do not fit (0/1 used)" in caplog.text
    engine.close()


def test_a_corrupt_reload_is_recomputed_never_used(expected, tmp_path, caplog):
    engine = tight(
        tmp_path, preemption="tiered", spill_host_blocks=0, spill_cxl_blocks=0
    )  # everything goes to disk
    corrupted: list[str] = []

    def corrupt_first_spill(e):
        disk = e.spiller.store.tiers[-1]
        for key, entry in list(disk._entries.items()):
            if not corrupted and entry.written.wait(5):
                with open(entry.path, "r+b") as f:
                    f.seek(-1, os.SEEK_END)
                    last = f.read(1)[0]
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([last ^ 0x55]))
                corrupted.append(key)

    tokens, outs = run(engine, corrupt_first_spill)
    assert corrupted, "the test needs at least one spill"
    assert tokens == expected  # the corrupted request was recomputed, not answered wrongly
    assert engine.spiller.failed_reloads == 1
    assert engine.scheduler.recomputed_tokens > 0
    assert "checksum" in caplog.text
    engine.close()


def test_abort_of_a_parked_request_drops_its_spilled_kv(tmp_path):
    engine = tight(tmp_path, preemption="swap")
    for p in PROMPTS:
        engine.add_request(p, PARAMS)
    while not engine.scheduler.swapped:
        engine.step()
        engine.check_integrity()
    victim = engine.scheduler.swapped[0].request_id
    assert victim in engine.spiller.store
    assert engine.abort_request(victim)
    assert victim not in engine.spiller.store
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.spiller.store.stats()["host"]["used_blocks"] == 0
    engine.close()


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="preemption: 'drop'"):
        LLMEngine("tiny-llama", EngineArgs(preemption="drop"))
