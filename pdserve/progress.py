"""Progress bars: tqdm when installed, a plain line per 10% otherwise (GPU nodes that carry
only torch and triton can still run the kernel benchmark from the source tree)."""

from __future__ import annotations

import sys
from collections.abc import Iterable


class _Plain:
    def __init__(self, iterable=None, total=None, desc="", disable=False, **_):
        self.iterable = iterable
        self.total = total if total is not None else (len(iterable) if iterable is not None else 0)
        self.desc, self.disable, self.n, self._shown = desc, disable, 0, -1

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)

    def update(self, n: int = 1) -> None:
        self.n += n
        tenth = 10 * self.n // max(self.total, 1)
        if not self.disable and tenth != self._shown:
            self._shown = tenth
            print(f"{self.desc}: {self.n}/{self.total}", file=sys.stderr, flush=True)

    def set_postfix(self, **_) -> None:
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def progress(iterable: Iterable | None = None, **kwargs):
    try:
        from tqdm import tqdm
    except ImportError:
        return _Plain(iterable, **kwargs)
    return tqdm(iterable, **kwargs)
