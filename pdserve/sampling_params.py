"""Per-request sampling parameters, validated on construction.

A temperature below `GREEDY_BELOW` counts as greedy (vLLM's `_SAMPLING_EPS`): dividing logits
by a float32 denormal such as 1e-45 overflows them to inf, and the softmax of those is NaN.
Every bound is also the wire's (pdserve.proto): max_tokens, top_k and stop ids are int32, the
seed an int64, and the temperature a float32, which would turn anything above its largest
value into inf.
"""

from __future__ import annotations

from dataclasses import dataclass

GREEDY_BELOW = 1e-5  # temperatures in [0, GREEDY_BELOW) sample the argmax
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1
INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # finite, >= 0; below GREEDY_BELOW means greedy
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
        if not 1 <= self.max_tokens <= INT32_MAX:
            bad("max_tokens", f"must be in [1, {INT32_MAX}], got {self.max_tokens}")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            bad(
                "temperature",
                f"must be a finite number in [0, {FLOAT32_MAX:.4g}], got {self.temperature!r}",
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            bad("top_k", f"must be an int, got {self.top_k!r}")
        if not -1 <= self.top_k <= INT32_MAX:
            bad("top_k", f"must be -1, 0 (disabled) or in [1, {INT32_MAX}], got {self.top_k}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not INT64[0] <= self.seed <= INT64[1]
        ):
            bad("seed", f"must be an int64 or None, got {self.seed!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX for t in ids
        ):
            bad("stop_token_ids", f"must be a list of ints in [0, {INT32_MAX}], got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or self.logprobs < 0
        ):
            bad("logprobs", f"must be an int >= 0, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        """Argmax sampling; the sampler never divides by a greedy request's temperature."""
        return self.temperature < GREEDY_BELOW


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
