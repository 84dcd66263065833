"""Reservations: blocks a decode worker holds for prompts whose KV is still being pushed.

    FREE -reserve(lease)-> RESERVED -KV arrived + Start-> RUNNING (the engine core's)
                              └──── lease expired / release ────────────────> FREE

Push notifications arrive for the whole agent at once; `note_arrivals` keeps only those of
reservations still held, so a push that lands after its reservation was released or expired
is dropped at once instead of waiting forever (and can never start a later request of the
same id: a new reservation clears what an old one left).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from pdserve.engine.request import Request


@dataclass
class Reservation:
    request: Request
    deadline: float  # time.monotonic() after which the blocks go back to the pool
    cached_blocks: int = 0  # leading blocks that already hold the prompt's KV
    reserved_at: float = field(default_factory=time.monotonic)


class Reservations:
    def __init__(self) -> None:
        self._held: dict[str, Reservation] = {}
        self._arrived: set[str] = set()  # request ids whose push completed

    def add(self, res: Reservation) -> None:
        rid = res.request.request_id
        assert rid not in self._held, f"{rid} is reserved already"
        self._arrived.discard(rid)
        self._held[rid] = res

    def pop(self, request_id: str) -> Reservation | None:
        self._arrived.discard(request_id)
        return self._held.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def requests(self) -> Iterator[Request]:
        for res in self._held.values():
            yield res.request

    def expired(self, now: float) -> list[Reservation]:
        """Remove and return every reservation whose lease ran out."""
        gone = [rid for rid, res in self._held.items() if res.deadline < now]
        return [self.pop(rid) for rid in gone]

    def note_arrivals(self, notes: Iterable[bytes]) -> None:
        """Push-complete notifications (request ids); those of no held reservation drop."""
        for note in notes:
            rid = note.decode(errors="replace")
            if rid in self._held:
                self._arrived.add(rid)

    def take_arrival(self, request_id: str) -> bool:
        if request_id in self._arrived:
            self._arrived.discard(request_id)
            return True
        return False

    @property
    def pending_arrivals(self) -> int:
        """Notifications kept for reservations not started yet (never more than held)."""
        return len(self._arrived)
