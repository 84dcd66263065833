"""Reservations: blocks a decode worker holds for prompts whose KV is still being pushed.

    FREE -reserve(lease, push window)-> RESERVED -KV arrived + Start-> RUNNING (the core's)
                                           │ lease expired / release
                                           ├── push arrived ────────────────────> FREE
                                           └── push not arrived -> FENCED -its notification
                                                                  (or "nothing posted")
                                                                  or the window end-> FREE

Every reservation gets a fencing token (`fence`, unique in this process). The prefill
worker's push carries it in its notification (transfer/wire.py `notification`); a notification
whose token is not the reservation's (a push for an earlier reservation of the same id, or
for none) is dropped, so it can never start a later request.

Fencing the blocks themselves: a push is a one-sided WRITE into this pool, which this side
cannot refuse. So blocks of a reservation that ends before its push arrived are not handed
to anyone until that push can no longer land: its notification came (the writer is done),
or the push window the router named at Reserve is over (the router gives the prefill worker
a deadline inside that window, and the prefill worker posts no WRITE after its deadline), or
the prefill worker said it gave the prompt up before posting anything (a notification alone,
transfer/wire.py `unposted_notification`: a cancelled call's prompt dropped from its queue).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from pdserve.engine.request import Request
from transfer import parse_notification


@dataclass
class Reservation:
    request: Request
    deadline: float  # time.monotonic() after which the lease is over (Renew extends it)
    cached_blocks: int = 0  # leading blocks that already hold the prompt's KV
    reserved_at: float = field(default_factory=time.monotonic)
    push_deadline: float = float("inf")  # no push of this reservation lands after it
    fence: int = 0  # set by Reservations.add


class Reservations:
    def __init__(self) -> None:
        self._held: dict[str, Reservation] = {}
        self._arrived: set[str] = set()  # request ids whose push completed
        self._fenced: dict[int, Reservation] = {}  # fence -> ended before its push arrived
        self._fenced_done: set[int] = set()  # fenced ones whose push notification came
        # fence -> the parts of its push whose notifications came (a push from a tensor
        # parallel group is one WRITE stream per pair of ranks, each with its notification)
        self._parts: dict[int, set[int]] = {}
        self._fences = itertools.count(1)
        # held ones whose prefill worker said no WRITE of them was or will be posted (it
        # gave the prompt up): their end frees the blocks at once
        self._unposted: set[str] = set()

    def add(self, res: Reservation) -> int:
        """Hold `res` -> its fencing token."""
        rid = res.request.request_id
        assert rid not in self._held, f"{rid} is reserved already"
        self._arrived.discard(rid)
        res.fence = next(self._fences)
        self._held[rid] = res
        return res.fence

    def pop(self, request_id: str) -> Reservation | None:
        """Take the reservation out to start it (its push arrived, or the caller knows)."""
        res = self._take(request_id)
        if res is not None:
            self._parts.pop(res.fence, None)
        return res

    def _take(self, request_id: str) -> Reservation | None:
        self._arrived.discard(request_id)
        self._unposted.discard(request_id)
        return self._held.pop(request_id, None)

    def end(
        self, request_id: str, now: float, unpushed: bool = False
    ) -> tuple[Reservation | None, bool]:
        """A held reservation that will not start -> (it, whether its blocks may go back to
        the pool now: its push arrived, its window is over, or the caller knows no push was
        ever posted). When its push may still land, it is fenced instead: its blocks come
        back from `unfenced()`."""
        arrived = request_id in self._arrived
        unpushed = unpushed or request_id in self._unposted
        res = self._take(request_id)
        if res is None and unpushed:  # ended and fenced before: the caller knows better now
            fence = next(
                (f for f, r in self._fenced.items() if r.request.request_id == request_id), None
            )
            if fence is not None:
                self._fenced_done.discard(fence)
                self._parts.pop(fence, None)
                return self._fenced.pop(fence), True
        if res is None:
            return None, False
        if arrived or unpushed or res.push_deadline <= now:
            self._parts.pop(res.fence, None)
            return res, True
        self._fenced[res.fence] = res  # its parts so far stay: the rest may still come
        return res, False

    def renew(self, request_id: str, fence: int, lease_s: float, now: float) -> bool:
        res = self._held.get(request_id)
        if res is None or res.fence != fence:
            return False
        res.deadline = max(res.deadline, now + lease_s)
        return True

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def get(self, request_id: str) -> Reservation | None:
        return self._held.get(request_id)

    def requests(self) -> Iterator[Request]:
        """Every request whose blocks this book keeps out of the pool (fenced ones too)."""
        for res in self._held.values():
            yield res.request
        for res in self._fenced.values():
            yield res.request

    def expired(self, now: float) -> list[str]:
        """Ids of the held reservations whose lease ran out (for `end`)."""
        return [rid for rid, res in self._held.items() if res.deadline < now]

    def unfenced(self, now: float) -> list[Reservation]:
        """Remove and return the fenced reservations whose push can no longer land."""
        free = [
            f
            for f, res in self._fenced.items()
            if f in self._fenced_done or res.push_deadline <= now
        ]
        self._fenced_done.difference_update(free)
        for f in free:
            self._parts.pop(f, None)
        return [self._fenced.pop(f) for f in free]

    def note_arrivals(self, notes: Iterable[bytes]) -> None:
        """Push-complete notifications; only those carrying a held or fenced reservation's
        own token count, the rest drop. A push in several parts has arrived when every
        part's notification has."""
        for note in notes:
            parsed = parse_notification(note)
            if parsed is None:
                continue
            rid, fence, part, parts, unposted = parsed
            held = self._held.get(rid)
            fenced = self._fenced.get(fence)
            if unposted:  # nothing of it will land: an end (or the fence's) frees it at once
                if held is not None and held.fence == fence:
                    self._unposted.add(rid)
                elif fenced is not None and fenced.request.request_id == rid:
                    self._fenced_done.add(fence)
                continue
            if held is not None and held.fence == fence:
                done = self._arrived
                key: str | int = rid
            elif fenced is not None and fenced.request.request_id == rid:
                done, key = self._fenced_done, fence
            else:
                continue  # of no reservation here (an earlier one of the same id, or none)
            if self._complete(fence, part, parts):
                done.add(key)

    def _complete(self, fence: int, part: int, parts: int) -> bool:
        got = self._parts.setdefault(fence, set())
        got.add(part)
        return len(got) >= parts

    def arrived(self, request_id: str) -> bool:
        """Whether the push of this held reservation is in (kept until it starts or
        ends: an end after the arrival frees the blocks at once)."""
        return request_id in self._arrived

    @property
    def pending_arrivals(self) -> int:
        """Notifications kept for reservations not started yet (never more than held)."""
        return len(self._arrived)

    @property
    def fenced(self) -> int:
        """Reservations ended whose blocks wait for their push to be over."""
        return len(self._fenced)

    def check_integrity(self) -> None:
        assert self._arrived <= set(self._held), "an arrival of no held reservation"
        assert self._unposted <= set(self._held), "an unposted note of no held reservation"
        assert self._fenced_done <= set(self._fenced), "a done fence of no fenced reservation"
        live = {r.fence for r in self._held.values()} | set(self._fenced)
        assert set(self._parts) <= live, "push parts kept for a reservation that is gone"
        assert len({r.fence for r in self._held.values()} | set(self._fenced)) == len(
            self._held
        ) + len(self._fenced), "a fencing token used twice"
