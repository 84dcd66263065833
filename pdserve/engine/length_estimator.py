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

from bisect import bisect_right
from collections import deque
from itertools import accumulate

import numpy as np

MEMO_MAX = 4096


class OutputLengthEstimator:
    def __init__(self, window: int = 1000) -> None:
        if window <= 0:
            raise ValueError(f"window: must be > 0, got {window}")
        self._recent: deque[int] = deque(maxlen=window)
        # the observations sorted, with prefix sums of them and of their squares (exact
        # integers), rebuilt lazily after an observation: any (g, M) is then two bisections
        # and a few integer sums, where admission asks one per held request per check
        self._sorted: list[int] | None = []
        self._sums: list[int] = [0]
        self._squares: list[int] = [0]
        # answers since the last observation: admission asks the same (g, M) for every
        # request in a batch, once per candidate
        self._memo: dict[tuple[int, int], tuple[float, float]] = {}
        self._mean: float | None = None
        self._array: np.ndarray | None = None

    def observe(self, output_tokens: int) -> None:
        self._recent.append(int(output_tokens))
        self._sorted = None  # re-sorted lazily
        self._memo.clear()
        self._mean = None
        self._array = None

    @property
    def count(self) -> int:
        return len(self._recent)

    def mean_length(self) -> float | None:
        """The mean observed output length (None before the first)."""
        if self._mean is None and self._recent:
            self._mean = sum(self._recent) / len(self._recent)
        return self._mean

    def sorted_lengths(self) -> np.ndarray:
        """The observed lengths, ascending (int64; cached until the next observation)."""
        if self._array is None:
            self._array = np.sort(np.fromiter(self._recent, np.int64, len(self._recent)))
        return self._array

    def remaining(self, generated: int, max_tokens: int) -> float:
        """E_rem(g, M) above; never negative, never above M - g."""
        return self.moments(generated, max_tokens)[0]

    def moments(self, generated: int, max_tokens: int) -> tuple[float, float]:
        """(E_rem(g, M), the variance of the remaining length) under the same conditioning."""
        key = (generated, max_tokens)
        if key not in self._memo:
            if len(self._memo) >= MEMO_MAX:  # long runs with no request finishing
                self._memo.clear()
            self._memo[key] = self._moments(generated, max_tokens)
        return self._memo[key]

    def _moments(self, generated: int, max_tokens: int) -> tuple[float, float]:
        """The observed lengths that outlived `generated`, each capped at max_tokens: their
        mean less `generated`, and their variance (the cap M - g and 0 when there are none).
        Sums are exact integers, so each figure is rounded once."""
        if self._sorted is None:
            self._sorted = sorted(self._recent)
            self._sums = [0, *accumulate(self._sorted)]
            self._squares = [0, *accumulate(x * x for x in self._sorted)]
        lengths = self._sorted
        first = bisect_right(lengths, generated)
        n = len(lengths) - first
        if n == 0:
            return float(max(0, max_tokens - generated)), 0.0
        capped = max(first, bisect_right(lengths, max_tokens))  # from here on, each is M
        over = len(lengths) - capped
        total = self._sums[capped] - self._sums[first] + over * max_tokens
        squares = self._squares[capped] - self._squares[first] + over * max_tokens * max_tokens
        return total / n - generated, (n * squares - total * total) / (n * n)
