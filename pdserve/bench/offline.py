"""`pdserve bench offline`: LLM.generate against transformers' generate, same model and prompts.

Both run in this process on the same weights (transformers gets pdserve's loaded tensors) and
the same greedy sampling with EOS ignored, so every request produces exactly its `max_tokens`.

Workloads: see pdserve/bench/workload.py (default azure-conv).

At batch size B, pdserve gets the B requests at once and batches them continuously (a request
leaves the batch when it is done). transformers gets them as one left-padded batch and
generates until the longest request is done (its standard batched `generate`); only the
`max_tokens` of each request count as useful output. At B = 1 both run requests one by one,
alternating between the engines request by request.
Throughput = useful generated tokens / wall seconds, prefill included.
"""

from __future__ import annotations

import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.report import machine_info
from pdserve.bench.workload import Workload, make_workload
from pdserve.config import ModelConfig
from pdserve.progress import progress


def hf_model_from(llm: LLM):
    """A transformers LlamaForCausalLM holding the very tensors pdserve loaded."""
    import transformers

    cfg: ModelConfig = llm.model_config
    if cfg.architecture != "llama" or cfg.rope.rope_type != "default" or cfg.qkv_bias:
        raise ValueError("bench offline: the transformers baseline supports Llama-family models")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope.theta},
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(hf_cfg).to(llm.core.kv_pool.dtype)
    ours = llm.core.runner.model  # the real runner (pdserve/engine/model_runner.py)
    state = {}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, tensor in ours.state_dict().items():
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                state[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                state[name.replace("gate_up_proj", part)] = piece
        else:
            state[name] = tensor
    model.load_state_dict(state, strict=False)
    model.generation_config.eos_token_id = None  # EOS ignored, like ignore_eos=True
    model.generation_config.pad_token_id = 0
    return model.eval()


def run_pdserve(llm: LLM, work: Workload) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in work.max_tokens]
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params)
    elapsed = time.perf_counter() - start
    llm.check_integrity()
    return elapsed, [o.token_ids for o in outs]


@torch.inference_mode()
def run_transformers(model, work: Workload) -> tuple[float, list[list[int]]]:
    lengths = [len(p) for p in work.prompts]
    width = max(lengths)
    ids = torch.zeros(len(work.prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(work.prompts):  # left padding, as batched generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max(work.max_tokens), do_sample=False
    )
    elapsed = time.perf_counter() - start
    return elapsed, [out[i, width : width + m].tolist() for i, m in enumerate(work.max_tokens)]


def _one_by_one(llm: LLM, hf, work: Workload) -> tuple[float, list, float, list]:
    """Requests one at a time, alternating the two engines so machine noise hits both."""
    t_pd = t_hf = 0.0
    out_pd, out_hf = [], []
    for p, m in zip(work.prompts, work.max_tokens):
        one = Workload([p], [m])
        t, out = run_transformers(hf, one)
        t_hf, out_hf = t_hf + t, out_hf + out
        t, out = run_pdserve(llm, one)
        t_pd, out_pd = t_pd + t, out_pd + out
    return t_pd, out_pd, t_hf, out_hf


def bench_offline(
    model: str,
    batch_sizes: list[int],
    requests_at_batch_1: int = 4,
    workload: str = "azure-conv",
    seed: int = 0,
    **engine_args,
) -> dict:
    llm = LLM(model, max_num_seqs=max(batch_sizes), **engine_args)
    hf = hf_model_from(llm)
    vocab = llm.model_config.vocab_size
    warm = Workload([[vocab - 1] * 8, [vocab - 2] * 12], [4, 4])
    run_pdserve(llm, warm)
    run_transformers(hf, warm)
    rows = []
    for b in progress(batch_sizes, desc="bench offline", unit="batch size"):
        n = requests_at_batch_1 if b == 1 else b
        work = make_workload(n, vocab, seed + b, workload)
        if b == 1:
            t_pd, out_pd, t_hf, out_hf = _one_by_one(llm, hf, work)
        else:
            t_hf, out_hf = run_transformers(hf, work)
            t_pd, out_pd = run_pdserve(llm, work)
        same = sum(a == b for a, b in zip(out_pd, out_hf))
        rows.append(
            {
                "batch_size": b,
                "requests": n,
                "useful_tokens": work.useful_tokens,
                "prompt_tokens": sum(len(p) for p in work.prompts),
                "pdserve_s": t_pd,
                "transformers_s": t_hf,
                "pdserve_tok_s": work.useful_tokens / t_pd,
                "transformers_tok_s": work.useful_tokens / t_hf,
                "ratio": t_hf / t_pd,
                "identical_outputs": same,
            }
        )
    return {
        "benchmark": "offline",
        "model": model,
        "machine": machine_info(),
        "workload": {"kind": workload, "seed": seed, "sampling": "greedy, ignore_eos"},
        "engine_args": engine_args,
        "dtype": str(llm.core.kv_pool.dtype),
        "results": rows,
    }


def format_table(report: dict) -> str:
    lines = [
        f"offline throughput, {report['model']} ({report['dtype']}), "
        f"workload {report['workload']['kind']}, "
        f"{report['machine']['cpus']} CPUs, torch {report['machine']['torch']}",
        f"{'batch':>5} {'reqs':>5} {'tokens':>7} {'pdserve tok/s':>14} "
        f"{'transformers tok/s':>19} {'ratio':>6} {'same':>5}",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['batch_size']:>5} {r['requests']:>5} {r['useful_tokens']:>7} "
            f"{r['pdserve_tok_s']:>14.1f} {r['transformers_tok_s']:>19.1f} "
            f"{r['ratio']:>5.2f}x {r['identical_outputs']:>2}/{r['requests']:<2}"
        )
    lines.append("ratio = pdserve tok/s / transformers tok/s, both measured in this run")
    return "\n".join(lines)
