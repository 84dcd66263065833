"""`pdserve sim --max-tokens CAP`: each request's max_tokens is a client's cap and its length
is hidden until it samples its stop token (pdserve/sim/runner.py), so a policy that reads
max_tokens no longer knows every request's exact length."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from pdserve.bench.workload import RequestSpec, specs_of
from pdserve.engine.args import EngineArgs
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.output import HeldRequest
from pdserve.sampling_params import SamplingParams
from pdserve.sim.clock import VirtualClock
from pdserve.sim.cost import FittedCost
from pdserve.sim.profile import load_profile
from pdserve.sim.run import Setup, Topology, simulate
from pdserve.sim.runner import HiddenLength, SimRunner, request_params
from pdserve.weights import model_config

VOCAB = 1000


def chunk(tokens: list[int], start: int, params: SamplingParams) -> ScheduledChunk:
    return ScheduledChunk(tokens, start, [0], True, params, None)


def test_the_runner_samples_the_stop_token_exactly_at_the_hidden_length():
    params = request_params(prompt_tokens=5, output_tokens=3, cap=100, vocab_size=VOCAB)
    assert isinstance(params, HiddenLength) and params.max_tokens == 100
    assert params.stop_token_ids == (VOCAB - 1,) and params.ends_at == 7
    runner = SimRunner(FittedCost({"intercept": 0.01}), VirtualClock(), VOCAB)
    # the prompt's pass samples output 1, then one token a step: the third is the stop
    sampled = [runner.execute([chunk(list(range(5)), 0, params)]).tokens[0]]
    for position in (5, 6):
        sampled.append(runner.execute([chunk([sampled[-1]], position, params)]).tokens[0])
    assert sampled[-1] == VOCAB - 1 and VOCAB - 1 not in sampled[:-1]
    # a recompute of the whole context samples the same stop at the same place, and so
    # does one whose first 4 tokens were a cached prefix
    context = [*range(5), *sampled[:2]]
    assert runner.execute([chunk(context, 0, params)]).tokens == [VOCAB - 1]
    assert runner.execute([chunk(context[4:], 4, params)]).tokens == [VOCAB - 1]
    # a part of a prompt that samples nothing, then the rest: the first output is no stop
    part = ScheduledChunk(list(range(3)), 0, [0], False, params, None)
    assert runner.execute([part, chunk([3, 4], 3, params)]).tokens != [VOCAB - 1]
    # one request ends while another in the same step goes on
    longer = request_params(5, 9, 100, VOCAB)
    both = runner.execute([chunk(context, 0, params), chunk(context, 0, longer)]).tokens
    assert both[0] == VOCAB - 1 and both[1] != VOCAB - 1
    # lengths as max_tokens: the benchmarks' way, the stop token never forced
    given = request_params(5, 3, None, VOCAB)
    assert type(given) is SamplingParams and given.max_tokens == 3 and given.ignore_eos


def test_a_cap_the_workload_does_not_fit_is_refused_by_name_before_anything_runs():
    with pytest.raises(ValueError, match="max_tokens: a request of the workload generates 9"):
        request_params(4, 9, 8, VOCAB)
    config = model_config("tiny-llama")
    with pytest.raises(ValueError, match="max_tokens: must be >= 1"):
        Setup(config, load_profile("h200"), Topology(), EngineArgs(), max_tokens=0)
    args = EngineArgs(block_size=4, num_kv_blocks=60, max_model_len=100)
    specs = [RequestSpec(0.0, 10, 5)] * 3 + [RequestSpec(0.0, 10, 40)]
    with pytest.raises(ValueError, match="generates 40 tokens, past the cap 30"):
        simulate(Setup(config, load_profile("h200"), Topology(), args, max_tokens=30),
                 "greedy+recompute", specs, 2, label="")  # fmt: skip
    specs = [RequestSpec(0.0, 70, 5)]
    with pytest.raises(ValueError, match=r"prompt \(70 tokens\) plus the cap 40 exceeds"):
        simulate(Setup(config, load_profile("h200"), Topology(), args, max_tokens=40),
                 "greedy+recompute", specs, 2, label="")  # fmt: skip


def colocated(max_tokens: int | None) -> Setup:
    args = EngineArgs(block_size=4, num_kv_blocks=60)
    return Setup(model_config("tiny-llama"), load_profile("h200"), Topology(), args, seed=3,
                 max_tokens=max_tokens)  # fmt: skip


def test_hidden_lengths_end_each_request_at_its_length_and_greedy_does_not_notice():
    """Greedy admission never reads max_tokens: its run is the same figure for figure with
    the lengths given or hidden. Every request generates its workload length either way.
    kv-aware admission reads the cap: it holds each request at 120 tokens instead of its
    length, so it admits fewer at once and preempts less."""
    specs = specs_of("reasoning", 24, seed=3, mean_output=40, max_output=70)
    figures = ("generated_tokens", "preemptions", "recomputed_tokens", "throughput_tok_s",
               "ttft_p99_s", "tpot_p99_s", "e2e_p50_s")  # fmt: skip
    for policy in ("greedy+recompute", "greedy+tiered"):
        given = simulate(colocated(None), policy, specs, 8, label="")
        hidden = simulate(colocated(120), policy, specs, 8, label="")
        assert {k: given[k] for k in figures} == {k: hidden[k] for k in figures}, policy
        assert given["preemptions"] > 0  # the pool is short: decisions were made
    total = sum(s.output_tokens for s in specs)
    given = simulate(colocated(None), "kv-aware+tiered", specs, 8, label="")
    hidden = simulate(colocated(120), "kv-aware+tiered", specs, 8, label="")
    assert given["generated_tokens"] == hidden["generated_tokens"] == total
    assert hidden["ttft_p50_s"] > given["ttft_p50_s"]  # it waits on caps it cannot see past


def test_the_admission_sees_the_cap_not_the_length(monkeypatch):
    """Every request admission looks at, colocated or on a cluster's decode workers (moved
    ones included: their output counts from their start, under the whole cap), is held at
    the cap."""
    seen: list[int] = []
    real = HeldRequest.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen.append(self.max_tokens)

    monkeypatch.setattr(HeldRequest, "__init__", spy)
    specs = specs_of("reasoning", 6, seed=1, mean_output=20, max_output=40)
    simulate(colocated(150), "kv-aware+tiered", specs, 3, label="")
    assert seen and set(seen) == {150}
    seen.clear()
    config = model_config("pdserve/sim/configs/qwen2.5-32b.json")
    specs = specs_of("reasoning", 40, seed=2, mean_output=400, max_output=1200)
    setup = Setup(config, load_profile("h200"), Topology(prefill=1, decode=2),
                  EngineArgs(block_size=16, num_kv_blocks=300), skew="late-join",
                  max_tokens=1200)  # fmt: skip
    moved = simulate(setup, "kv-aware+tiered+migrate", specs, concurrency=10, label="")
    assert moved["migrations"] > 0 and seen and set(seen) == {1200}


def test_a_migrated_request_keeps_its_hidden_length():
    """Skewed arrivals on a simulated 1P2D with +migrate and hidden lengths: requests move
    (the destination continues the same sequence) and each still ends at its length."""
    config = model_config("pdserve/sim/configs/qwen2.5-32b.json")
    specs = specs_of("reasoning", 60, seed=2, mean_output=400, max_output=1200)
    args = EngineArgs(block_size=16, num_kv_blocks=300)
    setup = Setup(config, load_profile("h200"), Topology(prefill=1, decode=2), args,
                  skew="late-join", max_tokens=1200)  # fmt: skip
    moved = simulate(setup, "greedy+recompute+migrate", specs, concurrency=10, label="")
    assert moved["errors"] == 0 and moved["migrations"] > 0
    assert moved["generated_tokens"] == sum(s.output_tokens for s in specs)
    given = simulate(dataclasses.replace(setup, max_tokens=None), "greedy+recompute+migrate",
                     specs, concurrency=10, label="")  # fmt: skip
    assert given["generated_tokens"] == moved["generated_tokens"]


@pytest.mark.parametrize("topology", [Topology(), Topology(prefill=1, decode=2)])
def test_a_request_whose_first_token_is_its_last_ends_there(topology):
    """A one-token request samples its stop where its prompt is computed (on a prefill
    worker, in a cluster): it ends there, as a model's EOS would end it."""
    specs = [RequestSpec(0.0, 20 + i, (1, 2, 3, 1, 5, 1, 2)[i % 7]) for i in range(14)]
    args = EngineArgs(block_size=4, num_kv_blocks=60)
    setup = Setup(model_config("tiny-llama"), load_profile("h200"), topology, args,
                  max_tokens=50)  # fmt: skip
    for policy in ("greedy+recompute", "cost-aware+tiered"):
        p = simulate(setup, policy, specs, 4, label="")
        assert p["errors"] == 0 and p["generated_tokens"] == 30


def test_the_command_line_takes_a_cap_and_says_so(tmp_path):
    out = tmp_path / "sim.json"
    argv = ["--model", "tiny-llama", "--num-kv-blocks", "40", "--block-size", "4",
            "--policy", "greedy+recompute,cost-aware+tiered", "--workload", "reasoning",
            "--mean-output", "30", "--max-output", "60", "--concurrency", "4"]  # fmt: skip
    run = [sys.executable, "-m", "pdserve.cli", "sim", *argv]
    proc = subprocess.run([*run, "--max-tokens", "60", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["max_tokens"] == 60 and "max_tokens 60, lengths hidden" in proc.stdout
    assert all(p["errors"] == 0 for p in report["points"])
    bad = subprocess.run([*run, "--max-tokens", "10"], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "max_tokens: a request of the workload generates" in bad.stderr
    assert "Traceback" not in bad.stderr
