"""The colocated engine's admission gate (pdserve/engine/gate.py): the LLM runs what a decode
worker runs given no flags, a refused request waits in front of the engine (nothing lost,
outputs unchanged), and an idle engine always takes the next request."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.admission import CostAwareAdmission, KVAwareAdmission
from pdserve.engine.output import HeldRequest

PROMPTS = [[i + 5] * 20 for i in range(6)]
PARAMS = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected():
    roomy = LLM("tiny-llama", block_size=4, num_kv_blocks=256, admission="greedy")
    return [o.token_ids for o in roomy.generate(PROMPTS, PARAMS)]


def _tight(**kwargs) -> LLM:
    return LLM("tiny-llama", block_size=4, num_kv_blocks=26, **kwargs)  # 2 requests at the end


def _empty(llm: LLM) -> None:
    llm.check_integrity()
    pool = llm.stats().pool
    assert pool.used_blocks == 0
    if pool.offloaded is not None:
        assert all(t["used_blocks"] == 0 for t in pool.offloaded.tiers.values())


def test_the_colocated_default_is_the_decode_workers_default(expected):
    llm = _tight()
    assert type(llm.gate.admission) is CostAwareAdmission
    assert llm.core.parks_victims  # preemption "tiered"
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats.recomputed_tokens == 0
    # every output is 30 tokens: no spread, the expected peak is exact, and nothing is
    # admitted past it while others wait in the queue (until 2026-12-07 the default
    # overcommitted into the tiers whatever waited, and parked)
    assert stats.preemptions == 0
    costs = llm.gate.admission.costs
    assert costs.step_s is not None and costs.step_s > 0  # learned from the steps it ran
    assert llm.gate.admission.estimator.mean_length() == PARAMS.max_tokens
    _empty(llm)
    llm.close()


def test_kv_aware_holds_requests_back_instead_of_preempting(expected):
    greedy = _tight(admission="greedy", preemption="recompute")
    assert greedy.gate.admission is None
    assert [o.token_ids for o in greedy.generate(PROMPTS, PARAMS)] == expected
    assert greedy.stats().preemptions > 0 and greedy.stats().recomputed_tokens > 0

    held = _tight(admission="kv-aware", preemption="recompute")
    assert type(held.gate.admission) is KVAwareAdmission
    outs = held.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == expected
    assert held.stats().preemptions == 0  # every request's growth was known to fit
    _empty(held)


def test_an_idle_engine_takes_a_request_the_policy_would_refuse():
    llm = _tight(admission="kv-aware", preemption="recompute")
    long = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)  # 25 of 26 blocks
    prompt = [7] * 20
    admission = llm.gate.admission
    held = [HeldRequest("other", 20, 0, long.max_tokens)]  # one such request running
    refused = admission.check(prompt, long.max_tokens, held)
    assert refused is not None and "exceeds" in refused
    assert admission.check(prompt, long.max_tokens, []) is None  # nothing held: it fits
    out = llm.generate([prompt, prompt], long)
    assert [len(o.token_ids) for o in out] == [80, 80]
    _empty(llm)


def test_bad_admission_settings_are_refused_with_their_name():
    with pytest.raises(ValueError, match="admission"):
        LLM("tiny-llama", admission="fifo")
    with pytest.raises(ValueError, match="admission_margin"):
        LLM("tiny-llama", admission="kv-aware", admission_margin=1.5)


def test_the_gate_holds_no_more_than_a_steps_worth(expected):
    llm = LLM("tiny-llama", block_size=4, num_kv_blocks=256, max_num_seqs=2)
    reqs = [llm.core.make_request(p, PARAMS, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    for req in reqs:
        llm.gate.offer(req)
    done = {}
    while llm.gate.busy:
        out = llm.gate.step()
        assert len(llm.core.held()) <= 2
        done.update({f.request_id: f.output_token_ids for f in out.finished})
    assert [done[r.request_id] for r in reqs] == expected  # all of them, in the end
    _empty(llm)


def test_the_gate_tells_its_policy_how_many_requests_wait(expected):
    """Cost-aware admission admits past the expected peak only with no line: the gate's
    line is its own queue, the request asked about included."""
    llm = _tight()
    seen: list[float | None] = []
    check = llm.gate.admission.check

    def spy(prompt, max_tokens, held, waiting=None):
        seen.append(waiting)
        return check(prompt, max_tokens, held, waiting)

    llm.gate.admission.check = spy
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    # the idle engine takes the first unasked; the second is asked with itself and the four
    # behind it waiting, the queue only shortens from there, and the last is asked alone
    assert seen[0] == len(PROMPTS) - 1
    assert seen == sorted(seen, reverse=True) and seen[-1] == 1
    _empty(llm)
    llm.close()
