"""pdserve against Hugging Face transformers on the same random-weight checkpoints."""

from __future__ import annotations

import pytest
import torch
from hf_models import KINDS

from pdserve import LLM, SamplingParams

MAX_NEW = 12
# fp32 on both sides; the paged, absorbed (MLA) and fused-projection computations reorder
# floating-point sums, so log-probabilities agree to ~1e-5, not bit for bit.
LOGPROB_ATOL = 1e-4


def prompts(vocab: int = 320) -> list[list[int]]:
    """Six prompts from 1 token to more than three 32-token blocks."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 7, 16, 33, 64, 101)]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def hf_first_logprobs(model, prompt: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt])).logits[0, -1].float()
    return logits.log_softmax(-1)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers(hf_checkpoints, kind, block_size):
    directory, hf = hf_checkpoints(kind)
    batch = prompts()
    expected = [hf_greedy(hf, p) for p in batch]
    assert any(len(set(e)) > MAX_NEW // 2 for e in expected), "degenerate reference outputs"
    llm = LLM(str(directory), block_size=block_size, enable_prefix_caching=False)
    vocab = llm.model_config.vocab_size
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=vocab)
    outs = llm.generate(batch, params)
    assert [o.token_ids for o in outs] == expected
    for out, prompt in zip(outs, batch):
        ref = hf_first_logprobs(hf, prompt)
        ours = torch.tensor([out.logprobs[0][t] for t in range(vocab)])
        torch.testing.assert_close(ours, ref, atol=LOGPROB_ATOL, rtol=0)
    llm.check_integrity()
    assert llm.stats().pool.used_blocks == 0


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_prefix_cache_hits_give_identical_tokens(hf_checkpoints, kind):
    directory, hf = hf_checkpoints(kind)
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 320, (40,), generator=gen).tolist()
    tails = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (1, 5, 20, 31)]
    batch = [shared + t for t in tails]
    expected = [hf_greedy(hf, p) for p in batch]
    llm = LLM(str(directory), block_size=16, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    first = llm.generate(batch[:1], params)  # fills the cache with the shared 2 full blocks
    assert first[0].metrics.cached_prompt_tokens == 0
    rest = llm.generate(batch[1:], params)
    assert [o.token_ids for o in first + rest] == expected
    # 40 shared tokens = 2 full 16-token blocks reused, never recomputed
    assert [o.metrics.cached_prompt_tokens for o in rest] == [32, 32, 32]
    # running the same prompt again hits every full block before its last token
    again = llm.generate(batch[3:], params)[0]
    assert again.token_ids == expected[3]
    assert again.metrics.cached_prompt_tokens == 64  # (71 - 1) // 16 = 4 blocks
    llm.check_integrity()


def test_chunked_prefill_matches_transformers(hf_checkpoints):
    directory, hf = hf_checkpoints("qwen2")
    batch = prompts()
    expected = [hf_greedy(hf, p) for p in batch]
    # a 24-token step budget splits every long prompt into several chunks
    llm = LLM(str(directory), block_size=16, max_num_batched_tokens=24)
    outs = llm.generate(batch, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    llm.check_integrity()
