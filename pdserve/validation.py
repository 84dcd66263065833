"""One request validation for every edge: the engine, the router and both workers.

    check = RequestValidator(vocab_size=..., max_model_len=..., tokenizer=tok, pool_blocks=...)
    token_ids = check.prompt("Hello")              # or a list of ids
    check.request(token_ids, params)               # length limits, stop ids

Every failure is a ValueError whose message starts with the field it names
(`prompt: empty prompt`, `max_tokens: ... exceeds max_model_len 2048`), which the edges turn
into INVALID_ARGUMENT / HTTP 400. Nothing here allocates or queues anything.

Cost guards run before the per-item work: a token-id list longer than max_model_len is
refused before its ids are checked, and text longer than max_model_len * MAX_TOKEN_CHARS
characters is refused before it is tokenized (it cannot fit unless its tokens average more
than MAX_TOKEN_CHARS characters, which no tokenizer we load does on real text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer

Prompt = str | Sequence[int]
MAX_TOKEN_CHARS = 64  # characters one token may stand for, in practice (a cost guard)


@dataclass(frozen=True)
class RequestValidator:
    vocab_size: int
    max_model_len: int
    tokenizer: Tokenizer | None = None
    # a pool that must hold a whole request (the engine's); None: not checked here
    pool_blocks: int | None = None
    block_size: int = 16

    def prompt(self, prompt: Prompt, field: str = "prompt") -> list[int]:
        """A prompt's token ids (text is tokenized)."""
        if isinstance(prompt, str):
            return self._text(prompt, field)
        # any sequence (a protobuf repeated field too: its length is checked before a copy)
        if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
            raise ValueError(f"{field}: expected a string or a list of token ids")
        if not prompt:
            raise ValueError(f"{field}: empty prompt")
        self._fits(len(prompt), field)
        vocab = self.vocab_size
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(
                    f"{field}[{i}]: token id {t!r} is outside the vocabulary [0, {vocab})"
                )
        return list(prompt)

    def _text(self, text: str, field: str) -> list[int]:
        if not text:
            raise ValueError(f"{field}: empty prompt")
        if self.tokenizer is None:
            raise ValueError(f"{field}: this model has no tokenizer; pass token ids")
        most = self.max_model_len * MAX_TOKEN_CHARS
        if len(text) > most:
            raise ValueError(
                f"{field}: {len(text)} characters cannot fit in max_model_len "
                f"{self.max_model_len} (at most {most} characters are tokenized)"
            )
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a JSON "\ud800"
                raise ValueError(
                    f"{field}: character {e.start} is a lone surrogate "
                    f"U+{ord(text[e.start]):04X}, which is not valid Unicode text"
                ) from None
        token_ids = self.tokenizer.encode(text)
        self._fits(len(token_ids), field)
        return token_ids

    def _fits(self, n: int, field: str) -> None:
        if n > self.max_model_len:
            raise ValueError(f"{field}: {n} tokens exceed max_model_len {self.max_model_len}")

    def request(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """Whether a request of these prompt ids and parameters can ever be served here."""
        if not isinstance(params, SamplingParams):
            raise ValueError("params: expected SamplingParams")
        n = len(token_ids)
        self._fits(n, "prompt")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt length {n} + max_tokens {params.max_tokens} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        if self.pool_blocks is not None:
            needed = -(-(n + params.max_tokens) // self.block_size)
            if needed > self.pool_blocks:
                raise ValueError(
                    f"max_tokens: prompt length {n} + max_tokens {params.max_tokens} "
                    f"needs {needed} KV blocks but the pool has {self.pool_blocks}"
                )
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary")

    def validate(self, prompt: Prompt, params: SamplingParams, field: str = "prompt") -> list[int]:
        """prompt() then request() -> the prompt's token ids."""
        token_ids = self.prompt(prompt, field)
        self.request(token_ids, params)
        return token_ids
