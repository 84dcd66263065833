"""Where an engine step's time goes: torch.profiler over one prefill of a whole prompt and
over a decode step of a batch, printing the operators by device time and by host time.

    PYTHONPATH=. python scripts/profile_steps.py [--prompt 1024] [--batch 32] [--context 1024]
        [--model random:pdserve/sim/configs/llama-3-8b.json] [--out DIR]

Runs on whatever device the engine picks (CUDA when there is one). The decode step is
profiled as the engine runs it (CUDA graphs on CUDA) and, on CUDA, eagerly too. Tables go
to stdout and, with --out, to DIR/profile-*.txt.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def _table(prof, sort: str, rows: int = 25) -> str:
    return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60)


def _profiled(label: str, fn, cuda: bool, out: str | None) -> None:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()  # warm-up (compiles, captures)
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    text = f"== {label}\n"
    if cuda:
        text += "-- by device time\n" + _table(prof, "cuda_time_total") + "\n"
    text += "-- by host time\n" + _table(prof, "cpu_time_total") + "\n"
    print(text)
    if out:
        name = label.split(":")[0].replace(" ", "-")
        with open(os.path.join(out, f"profile-{name}.txt"), "w") as f:
            f.write(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:pdserve/sim/configs/llama-3-8b.json")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    block_size = 16
    blocks = (args.batch + 2) * (-(-(max(args.prompt, args.context) + 64) // block_size))
    core, _ = build_engine(
        args.model,
        EngineArgs(
            block_size=block_size,
            num_kv_blocks=blocks,
            enable_prefix_caching=False,
            max_num_batched_tokens=max(2048, args.prompt),
        ),
    )
    cuda = core.kv_pool.device.type == "cuda"
    vocab = core.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    def prefill() -> None:
        req = core.make_request(prompt(args.prompt), SamplingParams(max_tokens=1))
        core.add(req)
        core.step()
        assert not core.has_unfinished

    _profiled(f"prefill: one prompt of {args.prompt} tokens", prefill, cuda, args.out)

    reqs = [core.make_request(prompt(args.context), GREEDY) for _ in range(args.batch)]
    for req in reqs:
        core.add(req)
    while any(r.num_output_tokens == 0 for r in reqs):
        core.step()
    _profiled(f"decode: {args.batch} x {args.context} tokens", core.step, cuda, args.out)
    graphs = getattr(core.runner, "graphs", None)
    if graphs is not None:
        core.runner.graphs = None
        _profiled(f"decode-eager: {args.batch} x {args.context} tokens", core.step, cuda, args.out)
        core.runner.graphs = graphs
    for req in reqs:
        core.abort(req.request_id)
    core.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
