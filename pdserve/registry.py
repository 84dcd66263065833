"""One registry idiom: a fixed, read-only map from a name a user types to what it names.

    ATTENTION = Registry("attention_backend", {"torch": TorchBackend, "triton": TritonBackend})
    backend_cls = ATTENTION["torch"]
    ATTENTION["cuda"]   # ValueError: attention_backend: unknown 'cuda'; choose one of torch, triton

Entries are whatever the caller needs (a class, a factory, a tuple of tier names); the
registry only names them. It is built once, complete, and cannot be changed afterwards, so
a module-level registry is a constant, not state. This module imports nothing of pdserve:
`kernels` and `transfer` use it too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, entries: Mapping[str, T]) -> None:
        if not entries:
            raise ValueError(f"{kind}: a registry needs at least one entry")
        self.kind = kind  # the field or flag a bad name is reported against
        self._entries = MappingProxyType(dict(entries))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"{self.kind}: unknown {name!r}; choose one of {', '.join(self._entries)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def check(self, name: str) -> str:
        """`name` when it is registered, else the same ValueError as lookup."""
        self[name]
        return name
