"""The simulated cluster takes turns at shared CPUs as a launched CPU cluster does
(pdserve/serving/cpu_lease.py): a prefill batch's forward pass alone, decode steps side by
side, decode waiting at the gate while a prefill batch waits, the waiting decode workers
first after a prefill turn (the handover)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.bench.workload import specs_of
from pdserve.engine.args import EngineArgs
from pdserve.sim.cluster import ClusterSim
from pdserve.sim.profile import Profile, load_profile, profile_from_dict
from pdserve.sim.run import Setup, Topology, simulate
from pdserve.weights import model_config

# this machine's calibrated profile (fitted costs of a CPU cluster), as committed
CPU_PROFILE = Path(__file__).parent.parent / "docs/results/cpu-profile-smollm2-2026-12-04.json"

Interval = tuple[str, float, float, int]  # (who, start, end, prompts: prefill only)


def _record(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Interval], list[tuple]]:
    """Every forward pass the simulated cluster runs -> (kind, start, end, prompts), and
    every time a worker joined the line for a turn -> (time, worker)."""
    passes: list[Interval] = []
    joins: list[tuple] = []
    prefill_batch, step_start = ClusterSim._prefill_batch, ClusterSim._step_start
    turn_end = ClusterSim._prefill_turn_end

    def rejoin(self, now, again):
        turn_end(self, now, again)
        if again is not None:  # a part of its prompt left: it waits for a turn again
            joins.append((now, again.name))

    def decode(self, now, d):
        step_start(self, now, d)
        if self.cpu is not None and d in self.cpu.decode_line:
            joins.append((now, d.name))

    prefill_compute, step_run = ClusterSim._prefill_compute, ClusterSim._step_run

    def batch(self, now, p):
        prefill_batch(self, now, p)
        if self.cpu is not None and p in self.cpu.prefill_line:
            joins.append((now, p.name))

    def prefill(self, now, p, runnable):
        prefill_compute(self, now, p, runnable)
        passes.append((p.name, now, now + p.engine.runner.last_seconds, len(runnable)))

    def step(self, now, d, plan):
        step_run(self, now, d, plan)
        passes.append((d.name, now, now + d.engine.runner.last_seconds, 0))

    monkeypatch.setattr(ClusterSim, "_prefill_batch", batch)
    monkeypatch.setattr(ClusterSim, "_step_start", decode)
    monkeypatch.setattr(ClusterSim, "_prefill_turn_end", rejoin)
    monkeypatch.setattr(ClusterSim, "_prefill_compute", prefill)
    monkeypatch.setattr(ClusterSim, "_step_run", step)
    return passes, joins


def _setup(shares: bool, prefill: int = 1, turn_s: float = 0.25) -> Setup:
    profile = dataclasses.replace(load_profile(str(CPU_PROFILE)), shares_cpus=shares)
    args = EngineArgs(block_size=4, num_kv_blocks=80)
    topology = Topology(prefill=prefill, decode=2)
    return Setup(model_config("tiny-llama"), profile, topology, args, turn_s=turn_s)


@pytest.mark.parametrize(
    ("policy", "prefill", "turn_s"),
    [
        ("greedy+recompute", 1, 0.25),
        ("cost-aware+tiered", 1, 0.25),
        ("greedy+recompute", 2, 0.25),
        ("greedy+recompute", 1, 1e-9),
    ],
    ids=["greedy", "cost-aware", "two-prefill-workers", "prompts-in-parts"],
)
def test_prefill_computes_alone_and_decode_waits_at_the_gate(monkeypatch, policy, prefill, turn_s):
    specs = specs_of("reasoning", 40, seed=1, mean_output=30, max_output=60)
    passes, joins = _record(monkeypatch)
    point = simulate(_setup(True, prefill, turn_s), policy, specs, concurrency=12, label="")
    assert point["errors"] == 0
    assert point["generated_tokens"] == sum(s.output_tokens for s in specs)
    eps = 1e-12
    prefills = sorted((a, b, who) for who, a, b, _ in passes if who.startswith("prefill"))
    steps = [(who, a, b) for who, a, b, _ in passes if who.startswith("decode")]
    assert prefills and steps
    for a, b, _ in prefills:  # no decode step overlaps a prefill pass
        assert not [s for s in steps if s[1] < b - eps and s[2] > a + eps]
    for (_, b1, _), (a2, _, _) in zip(prefills, prefills[1:]):  # nor another prefill pass
        assert a2 >= b1 - eps
    ends = {round(b, 9) for _, b, _ in prefills}
    # the gate: while a prefill batch waits for its turn, a decode step starts only as a
    # prefill turn ends (the handover to the decode workers that waited for it)
    waited = 0
    for joined, who in joins:
        if who.startswith("decode"):  # the handover: it steps as the next prefill turn ends
            began = min(a for w, a, _ in steps if w == who and a >= joined - eps)
            assert began == min(b for _, b, _ in prefills if b > joined + eps), (who, joined)
            continue
        began = min(a for a, _, w in prefills if w == who and a >= joined - eps)
        inside = [a for _, a, _ in steps if joined + eps < a < began - eps]
        assert all(round(a, 9) in ends for a in inside), (who, joined, began, inside)
        waited += began > joined + eps
    assert waited, "no prefill batch ever waited for its turn: the gate was not exercised"
    # the handover: decode steps that waited start as a prefill turn ends
    assert any(round(a, 9) in ends for _, a, _ in steps)
    d0 = [(a, b) for k, a, b in steps if k == "decode-0"]
    d1 = [(a, b) for k, a, b in steps if k == "decode-1"]
    assert any(a0 < b1 and a1 < b0 for a0, b0 in d0 for a1, b1 in d1)  # side by side
    first = next(n for who, *_, n in passes if who.startswith("prefill"))
    assert first == 1  # the first batch is one prompt: nothing measured yet
    if turn_s < 1e-6:  # a turn per part: more passes than prompts, each a prompt's own
        assert len(prefills) > len(specs)
        assert all(n == 1 for who, *_, n in passes if who.startswith("prefill"))


def test_without_shared_cpus_prefill_and_decode_overlap(monkeypatch):
    specs = specs_of("reasoning", 40, seed=1, mean_output=30, max_output=60)
    passes, joins = _record(monkeypatch)
    point = simulate(_setup(False), "greedy+recompute", specs, concurrency=12, label="")
    assert point["errors"] == 0 and not joins
    prefills = [(a, b) for who, a, b, _ in passes if who.startswith("prefill")]
    steps = [(a, b) for who, a, b, _ in passes if who.startswith("decode")]
    assert any(sa < b and sb > a for a, b in prefills for sa, sb in steps)


def test_turns_cost_decode_time_while_prompts_compute():
    """The same load with and without turns: the same tokens; decode steps wait for the
    prompts' passes, so the median TPOT is longer with turns at every seed."""
    for seed in range(3):
        specs = specs_of("reasoning", 40, seed=seed, mean_output=30, max_output=60)
        split, shared = (
            simulate(_setup(s), "greedy+recompute", specs, concurrency=12, label="")
            for s in (False, True)
        )
        assert shared["generated_tokens"] == split["generated_tokens"]
        assert shared["tpot_p50_s"] > split["tpot_p50_s"]


@pytest.mark.parametrize("turn_s", [-1.0, float("inf"), float("nan")])
def test_a_turn_that_is_not_a_finite_number_is_refused(turn_s):
    with pytest.raises(ValueError, match="turn_s"):
        _setup(True, turn_s=turn_s)


def test_the_profile_field_is_checked():
    raw = dataclasses.asdict(load_profile(str(CPU_PROFILE)))
    assert profile_from_dict({**raw, "shares_cpus": True}).shares_cpus is True
    assert load_profile(str(CPU_PROFILE)).shares_cpus is False  # measured with split CPUs
    with pytest.raises(ValueError, match="shares_cpus: true or false"):
        profile_from_dict({**raw, "shares_cpus": "false"})
    gpu = dataclasses.asdict(load_profile("h200"))
    with pytest.raises(ValueError, match="GPU workers do not take turns"):
        profile_from_dict({**gpu, "shares_cpus": True})
    assert isinstance(load_profile("h200"), Profile) and not load_profile("h200").shares_cpus
