"""Greedy tokens of the colocated engine and of launched clusters, for comparing two trees.

    PYTHONPATH=/path/to/other/tree python scripts/greedy_tokens.py --json out/a.json
    python scripts/greedy_tokens.py --json out/b.json --compare out/a.json

Only the public API is used (`pdserve.LLM`, `pdserve.launch.Cluster`, `pdserve.client.Client`),
so the same script runs on an older main and on the current one. Every case runs the same
prompts (1 to 100 tokens, greedy, ignore_eos); `--compare` exits 1 on any difference and
prints where.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

CASES = (  # (name, model, prefill workers, decode workers); 0 workers: the colocated engine
    ("colocated-llama", "tiny-llama", 0, 0),
    ("colocated-qwen2", "tiny-qwen2", 0, 0),
    ("colocated-deepseek", "tiny-deepseek", 0, 0),
    ("colocated-smollm2", "smollm2-135m", 0, 0),
    ("1p1d-llama", "tiny-llama", 1, 1),
    ("2p2d-llama", "tiny-llama", 2, 2),
    ("1p1d-deepseek", "tiny-deepseek", 1, 1),
    ("2p2d-deepseek", "tiny-deepseek", 2, 2),
)
MAX_TOKENS = 12


def prompts(vocab: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = (1, 2, 15, 16, 17, 33, 64, 100)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def run_case(model: str, prefill: int, decode: int) -> list[list[int]]:
    from pdserve import LLM, SamplingParams
    from pdserve.weights import resolve

    work = prompts(resolve(model).config.vocab_size)
    if not prefill:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        return [o.token_ids for o in LLM(model).generate(work, params)]
    from pdserve.client import Client
    from pdserve.launch import Cluster

    with Cluster(model, prefill, decode, worker_args=["--num-kv-blocks", "64"]) as cluster:
        client = Client(cluster.address)
        out = [
            client.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True).token_ids
            for p in work
        ]
        client.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--compare", default=None, help="an earlier --json to compare with")
    parser.add_argument("--cases", default=",".join(c[0] for c in CASES))
    args = parser.parse_args()
    wanted = set(args.cases.split(","))
    report = {}
    for name, model, p, d in CASES:
        if name in wanted:
            started = time.monotonic()
            report[name] = run_case(model, p, d)
            print(f"{name}: {len(report[name])} prompts in {time.monotonic() - started:.0f}s")
    with open(args.json, "w") as f:
        json.dump(report, f)
    if args.compare is None:
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    differ = [k for k in report if before.get(k) != report[k]]
    for k in differ:
        print(f"DIFFERENT: {k}\n  before {before.get(k)}\n  now    {report[k]}")
    print(f"{len(report) - len(differ)} of {len(report)} cases identical to {args.compare}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
