"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 or -1: no top-k; else >= 1
    seed: int | None = None  # same seed -> same tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # top-k log-probabilities returned per generated token

    def __post_init__(self) -> None:
        def bad(field: str, message: str) -> None:
            raise ValueError(f"{field}: {message}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            bad("max_tokens", f"must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            bad("top_k", f"must be an int, got {self.top_k!r}")
        if self.top_k < -1:
            bad("top_k", f"must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            bad("seed", f"must be an int or None, got {self.seed!r}")
        ids = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            bad("stop_token_ids", f"must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or self.logprobs < 0
        ):
            bad("logprobs", f"must be an int >= 0, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
