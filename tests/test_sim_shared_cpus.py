"""The simulated cluster takes turns at shared CPUs as a launched CPU cluster does
(pdserve/serving/cpu_lease.py): a prefill batch's forward pass alone, decode steps side by
side, decode waiting at the gate while a prefill batch waits."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.bench.workload import specs_of
from pdserve.engine.args import EngineArgs
from pdserve.sim.cluster import ClusterSim
from pdserve.sim.profile import load_profile, profile_from_dict
from pdserve.sim.run import Setup, Topology, simulate
from pdserve.weights import model_config


def _intervals(monkeypatch) -> list[tuple[str, float, float, int]]:
    """Every forward pass the simulated cluster runs -> (kind, start, end, prompts)."""
    seen = []
    prefill_compute, step_run = ClusterSim._prefill_compute, ClusterSim._step_run

    def prefill(self, now, p, runnable):
        prefill_compute(self, now, p, runnable)
        seen.append(("prefill", now, now + p.engine.runner.last_seconds, len(runnable)))

    def step(self, now, d, plan):
        step_run(self, now, d, plan)
        seen.append((d.name, now, now + d.engine.runner.last_seconds, 0))

    monkeypatch.setattr(ClusterSim, "_prefill_compute", prefill)
    monkeypatch.setattr(ClusterSim, "_step_run", step)
    return seen


def _setup(shares: bool) -> Setup:
    profile = dataclasses.replace(load_profile("h200"), shares_cpus=shares)
    args = EngineArgs(block_size=4, num_kv_blocks=80)
    return Setup(model_config("tiny-llama"), profile, Topology(prefill=1, decode=2), args)


@pytest.mark.parametrize("policy", ["greedy+recompute", "cost-aware+tiered"])
def test_a_prefill_batch_computes_alone_and_decode_steps_wait_for_it(monkeypatch, policy):
    specs = specs_of("reasoning", 40, seed=1, mean_output=30, max_output=60)
    seen = _intervals(monkeypatch)
    point = simulate(_setup(True), policy, specs, concurrency=12, label="")
    assert point["errors"] == 0
    assert point["generated_tokens"] == sum(s.output_tokens for s in specs)
    prefills = [(a, b) for kind, a, b, _ in seen if kind == "prefill"]
    steps = [(kind, a, b) for kind, a, b, _ in seen if kind != "prefill"]
    assert prefills and steps
    eps = 1e-12
    for a, b in prefills:  # no decode step overlaps a prefill batch's forward pass
        assert not [s for s in steps if s[1] < b - eps and s[2] > a + eps]
    for (_, b1), (a2, _) in zip(prefills, prefills[1:]):  # nor another batch
        assert a2 >= b1 - eps
    # the handover: a decode step that waited starts as the batch's turn ends
    ends = {round(b, 9) for _, b in prefills}
    assert any(round(a, 9) in ends for _, a, _ in steps)
    # both decode workers' steps overlap each other somewhere (shared turns)
    d0 = [(a, b) for k, a, b in steps if k == "decode-0"]
    d1 = [(a, b) for k, a, b in steps if k == "decode-1"]
    assert any(a0 < b1 and a1 < b0 for a0, b0 in d0 for a1, b1 in d1)
    # batches sized by time: the first is one prompt (nothing measured yet)
    assert [n for kind, *_, n in seen if kind == "prefill"][0] == 1


def test_without_shared_cpus_prefill_and_decode_overlap(monkeypatch):
    specs = specs_of("reasoning", 40, seed=1, mean_output=30, max_output=60)
    seen = _intervals(monkeypatch)
    point = simulate(_setup(False), "greedy+recompute", specs, concurrency=12, label="")
    assert point["errors"] == 0
    prefills = [(a, b) for kind, a, b, _ in seen if kind == "prefill"]
    steps = [(a, b) for kind, a, b, _ in seen if kind != "prefill"]
    assert any(sa < b and sb > a for a, b in prefills for sa, sb in steps)


def test_sharing_costs_decode_time_while_prompts_compute():
    """The same load with and without turns: the same tokens, and decode waits for prefill
    (TPOT p99 no shorter, and longer somewhere across these seeds)."""
    longer = 0
    for seed in range(3):
        specs = specs_of("reasoning", 40, seed=seed, mean_output=30, max_output=60)
        split, shared = (
            simulate(_setup(s), "greedy+recompute", specs, concurrency=12, label="")
            for s in (False, True)
        )
        assert shared["generated_tokens"] == split["generated_tokens"]
        longer += shared["tpot_p99_s"] > split["tpot_p99_s"]
    assert longer >= 1


def test_the_profile_field_is_read_and_checked():
    raw = dataclasses.asdict(load_profile("h200"))
    assert profile_from_dict({**raw, "shares_cpus": True}).shares_cpus is True
    assert load_profile("h200").shares_cpus is False  # a GPU node's workers never share
