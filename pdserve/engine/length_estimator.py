"""An online estimate of how many more tokens a running request will generate.

Observations are the output lengths L of the last `window` requests that finished (by a stop
token or their length cap). For a request that has generated g tokens and may generate at
most M, the expected remaining output is

    E_rem(g, M) = mean over observed l > g of (min(l, M) - g)

(the observed lengths conditioned on having outlived g, capped by this request's own limit).
When nothing observed has outlived g, or nothing has been observed yet, the estimate is the
cap itself, M - g: a request the history cannot explain is assumed to run to its limit.
`moments(g, M)` gives the same mean and the variance of that conditional distribution (0
when it is the cap), for a policy that looks past the mean.
"""

from __future__ import annotations

from collections import deque

import numpy as np

MEMO_MAX = 4096


class OutputLengthEstimator:
    def __init__(self, window: int = 1000) -> None:
        if window <= 0:
            raise ValueError(f"window: must be > 0, got {window}")
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: np.ndarray | None = np.zeros(0, dtype=np.int64)
        # answers since the last observation: admission asks the same (g, M) for every
        # request in a batch, once per candidate (quadratic work without it)
        self._memo: dict[tuple[int, int], tuple[float, float]] = {}
        self._mean: float | None = None

    def observe(self, output_tokens: int) -> None:
        self._recent.append(int(output_tokens))
        self._sorted = None  # re-sorted lazily
        self._memo.clear()
        self._mean = None

    @property
    def count(self) -> int:
        return len(self._recent)

    def mean_length(self) -> float | None:
        """The mean observed output length (None before the first)."""
        if self._mean is None and self._recent:
            self._mean = float(np.mean(self._recent))
        return self._mean

    def remaining(self, generated: int, max_tokens: int) -> float:
        """E_rem(g, M) above; never negative, never above M - g."""
        return self.moments(generated, max_tokens)[0]

    def moments(self, generated: int, max_tokens: int) -> tuple[float, float]:
        """(E_rem(g, M), the variance of the remaining length) under the same conditioning."""
        key = (generated, max_tokens)
        if key not in self._memo:
            if len(self._memo) >= MEMO_MAX:  # long runs with no request finishing
                self._memo.clear()
            tail = self._tail(generated, max_tokens)
            self._memo[key] = (
                (float(max(0, max_tokens - generated)), 0.0)
                if tail is None
                else (float(tail.mean() - generated), float(tail.var()))
            )
        return self._memo[key]

    def _tail(self, generated: int, max_tokens: int) -> np.ndarray | None:
        """Observed lengths that outlived `generated`, capped at max_tokens (None: none)."""
        if self._sorted is None:
            self._sorted = np.sort(np.fromiter(self._recent, dtype=np.int64))
        tail = self._sorted[np.searchsorted(self._sorted, generated, side="right") :]
        return np.minimum(tail, max_tokens) if tail.size else None
