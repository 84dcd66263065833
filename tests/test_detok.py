"""The front door's incremental detokenizer (pdserve/openai/detok.py): the text of a
completion as its tokens arrive in any grouping, stop strings, held-back tails, a
SentencePiece-style decoder's leading space, and a bounded amount of decoding per token."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pdserve.openai.detok import TextStream
from pdserve.tokenizer import ByteTokenizer


class SentencePieceLike:
    """A Metaspace decoder, as Llama-2, Mistral and TinyLlama have: a sequence's first
    space is dropped (decode([Paris]) is "Paris", decode([is, Paris]) "is Paris")."""

    VOCAB = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4, ".": 5, "▁ok": 6}

    def __init__(self) -> None:
        self.backend = Tokenizer(models.WordLevel(self.VOCAB, unk_token="<unk>"))
        self.backend.pre_tokenizer = pre_tokenizers.Metaspace()
        self.backend.decoder = decoders.Metaspace()
        self.calls = 0
        self.decoded = 0  # tokens passed to decode, over all calls

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        self.decoded += len(ids)
        return self.backend.decode(ids, skip_special_tokens=True)


def run(stream: TextStream, ids: list[int], group: int = 1) -> str:
    out = "".join(stream.add(ids[i : i + group]) for i in range(0, len(ids), group))
    return out + stream.finish()


@pytest.mark.parametrize("group", [1, 2, 5])
def test_a_completion_keeps_the_space_it_starts_with(group):
    tok = SentencePieceLike()
    prompt = [1, 2, 3]  # "The capital is"
    assert run(TextStream(tok, [], prompt), [4, 5], group) == " Paris."
    assert tok.decode([4, 5]) == "Paris."  # what decoding the output alone gave
    assert run(TextStream(tok, []), [4, 5], group) == "Paris."  # no prompt: a sequence start


def reference(tok, ids: list[int], stops: list[str]) -> str:
    """The text the old detokenizer gave: the whole output decoded, cut at the first stop."""
    text = tok.decode(ids)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(hits)] if hits else text


@pytest.mark.parametrize("seed", range(40))
def test_any_grouping_of_utf8_bytes_gives_the_whole_outputs_text(seed):
    """Multi-byte characters split over tokens, invalid bytes, special ids that decode to
    nothing, stop strings inside characters' neighbourhoods: the deltas add up to the text
    of the whole output (cut at its first stop string), whatever the grouping."""
    rng = random.Random(seed)
    tok = ByteTokenizer(300)
    text = "".join(rng.choice(["a", "b", "é", "€", "𝄞", " ", "\n", "x"]) for _ in range(60))
    ids = list(text.encode()) + [rng.choice([65, 0xC3, 0xE2, 0xFF, 260])]
    for at in sorted(rng.sample(range(len(ids)), 3), reverse=True):
        ids.insert(at, 260)  # decodes to nothing
    stops = rng.choice([[], ["é€"], ["b a", "x\n"], ["zz"], ["𝄞"]])
    want = reference(tok, ids, stops)
    for group in (1, 2, 3, 7):
        stream = TextStream(tok, stops, prompt_ids=[0xC3])  # a prompt ending mid-character
        got = run(stream, ids, group)
        assert got == want, (group, stops)
        assert stream.stopped == (want != tok.decode(ids))


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot():
    tok = ByteTokenizer(300)
    stream = TextStream(tok, ["END"])
    assert stream.add(list(b"abcE")) == "abc"  # "E" may start "END"
    assert stream.add(list(b"N")) == ""
    assert stream.add(list(b"x")) == "ENx"  # it did not
    assert stream.add(list(b"yEND")) == "y" and stream.stopped
    assert stream.add(list(b"more")) == "" and stream.finish() == ""


def test_decoding_per_token_stays_bounded_on_a_long_output():
    """Each new token is decoded within a short window: a 4,000-token answer streamed a
    token a message decodes ~10 tokens a message, not the whole output again (~2,000)."""
    tok = SentencePieceLike()
    stream = TextStream(tok, ["never"], prompt_ids=[1, 2, 3])
    out = run(stream, [6] * 4000)
    assert out == " ok" * 4000
    assert tok.decoded / tok.calls < 10 and tok.calls <= 2 * 4000 + 4


def test_take_uses_the_tokens_up_to_the_one_that_completed_a_stop_string():
    """What usage counts: of a message's tokens, those up to the one that completed a stop
    string (none after it, none once stopped); all of them without stop strings."""
    tok = ByteTokenizer(300)
    stream = TextStream(tok, ["END"])
    assert stream.take(list(b"abE")) == ("ab", 3)
    assert stream.take(list(b"NDxyz")) == ("", 2) and stream.stopped  # "D" completed it
    assert stream.take(list(b"more")) == ("", 0)
    assert TextStream(tok, []).take(list(b"END")) == ("END", 3)
