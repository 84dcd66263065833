"""The line of requests waiting for decode room, served in order.

Before, every waiting request retried Reserve on its own backoff (10 -> 200 ms): whoever
happened to ask right after blocks were freed got them, usually a request that had just
arrived (a closed-loop client sends its next request the moment the last one ends) while
requests that had waited longest slept through their pause. In the 1P2D demo at 24 clients
that was a TTFT p99 of 126 s against a p50 of 9.5 s, and 15,000 refused Reserve calls at
that point (48 requests). Here only the request at the head of the line asks; the others
wait their turn, and the head asks again as soon as room may have come back (a request
ended, a reservation was released, a decode worker heartbeat) or its backoff runs out. A
resumed request (its client already has tokens) goes ahead of every new one, behind the
resumed ones already waiting. While nobody has been refused since the line was last empty
there is no line to keep: everyone asks at once (a burst of arrivals into free room is not
held to one Reserve at a time); the first request every worker refuses closes it to all
but the head until it empties again.

    ticket = line.join(front=resumed)
    try:
        while not reserved:
            if not line.wait_turn(ticket, 0.2):   # not the head yet: check the client, again
                continue
            line.asking(ticket)                   # kicks from now on count for this try
            reserved = try_every_worker()
            if not reserved:
                line.refused()                    # from now on only the head asks
                line.wait_room(ticket, pause)     # a kick or the pause, whichever first
    finally:
        line.leave(ticket)
"""

from __future__ import annotations

import threading
import time
from collections import deque


class Ticket:
    """One waiting request's place (compared by identity)."""

    __slots__ = ("kicks", "front")

    def __init__(self, front: bool = False) -> None:
        self.kicks = 0  # the line's kick count when this ticket last asked
        self.front = front  # a resumed request's: ahead of every new one


class ReserveLine:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[Ticket] = deque()
        self._kicks = 0  # how many times room may have come back
        self._closed = False  # someone was refused since the line was last empty

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    def join(self, front: bool = False) -> Ticket:
        ticket = Ticket(front)
        with self._cond:
            ticket.kicks = self._kicks
            if front:  # behind the resumed ones already there, ahead of every new one
                at = next((i for i, t in enumerate(self._queue) if not t.front), len(self._queue))
                self._queue.insert(at, ticket)
            else:
                self._queue.append(ticket)
            self._cond.notify_all()  # a new head (front) must not wait for the old one
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """Out of the line (reserved, gave up, aborted): the next one is the head."""
        with self._cond:
            try:
                self._queue.remove(ticket)
            except ValueError:
                return
            if not self._queue:
                self._closed = False
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """Whether only the head may ask (someone was refused since the line was empty)."""
        with self._cond:
            return self._closed

    def may_ask(self, ticket: Ticket) -> bool:
        """Whether `ticket` may ask now, without waiting: it is at the head, or the line is
        open (the simulator's router asks this; threads wait_turn())."""
        with self._cond:
            return self._may_ask(ticket)

    def _may_ask(self, ticket: Ticket) -> bool:
        return not self._closed or (bool(self._queue) and self._queue[0] is ticket)

    def refused(self) -> None:
        """Every worker refused a request: from now on only the head asks, until the line
        is empty."""
        with self._cond:
            self._closed = True

    def kick(self) -> None:
        """Room may have come back (a request ended, blocks were released): the head asks
        again now instead of at the end of its pause."""
        with self._cond:
            self._kicks += 1
            self._cond.notify_all()

    def wait_turn(self, ticket: Ticket, timeout: float) -> bool:
        """Whether `ticket` may ask now (it is at the head, or the line is open), waiting up
        to `timeout` seconds for it (a waiter returns now and then to check its client and
        its deadline)."""
        end = time.monotonic() + timeout
        with self._cond:
            while not self._may_ask(ticket):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def asking(self, ticket: Ticket) -> None:
        """`ticket` asks for room now: a kick from here on means the answer may be stale."""
        with self._cond:
            ticket.kicks = self._kicks

    def wait_room(self, ticket: Ticket, pause: float) -> bool:
        """After a refusal: until a kick since `ticket` last asked (True: ask again now) or
        `pause` seconds (False)."""
        end = time.monotonic() + pause
        with self._cond:
            while self._kicks == ticket.kicks:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def head(self) -> Ticket | None:
        with self._cond:
            return self._queue[0] if self._queue else None
