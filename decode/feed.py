"""A caller's feed: the tokens and ends of every stream its Starts bound to it, one batch a
decode step, for one gRPC message a step instead of one a token on each stream.

A stream that names no feed hands its events to its own Start call, one message a token:
32 streams meant 32 threads woken a step, each taking the GIL to send its token (~0.1 ms of
Python a token: 4-5% of a batch-32 CPU step; more than a whole step at a GPU's batch of
hundreds). A feed's entries wait for the step to end (`flush`); an end goes out at once,
with what waited before it, so that a stream's tokens and its end keep their order.

    Feed.add(stream, event)            under the worker's lock (the step loop, a Start, a
                                       release, a migration's end)
    Feed.flush()                       the step's entries -> one batch for the sender
    Feed.next_batch(timeout)           the Feed call's thread: a batch, [] on timeout,
                                       None once closed
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from decode.streams import EndEvent, StreamEvent

if TYPE_CHECKING:
    from decode.streams import Stream


@dataclass(frozen=True)
class FeedEntry:
    stream: Stream
    event: StreamEvent
    produced: int  # the stream's tokens handed over with this one (its end: all of them)


class Feed:
    def __init__(self, feed_id: str) -> None:
        self.feed_id = feed_id
        self._pending: list[FeedEntry] = []
        self._lock = threading.Lock()
        self._batches: queue.SimpleQueue[list[FeedEntry] | None] = queue.SimpleQueue()
        self.closed = False

    def add(self, stream: Stream, event: StreamEvent) -> None:
        with self._lock:
            if self.closed:  # its caller is gone, or opened it again (and resumes what this
                return  # one carried): the Starts bound to it are cancelled by the caller
            self._pending.append(FeedEntry(stream, event, stream.produced))
        if isinstance(event, EndEvent):
            self.flush()

    def flush(self) -> None:
        with self._lock:  # the put too: two threads' flushes never swap their batches
            if not self._pending or self.closed:
                return
            batch, self._pending = self._pending, []
            self._batches.put(batch)

    def next_batch(self, timeout_s: float) -> list[FeedEntry] | None:
        try:
            return self._batches.get(timeout=timeout_s)
        except queue.Empty:
            return None if self.closed else []

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._pending = []
        self._batches.put(None)


class Feeds:
    """The feeds open on a worker, by id: a caller that opens its feed again (its Feed call
    broke and it called again) replaces the old one, which ends."""

    def __init__(self) -> None:
        self._feeds: dict[str, Feed] = {}
        self._lock = threading.Lock()

    def open(self, feed_id: str) -> Feed:
        feed = Feed(feed_id)
        with self._lock:
            old, self._feeds[feed_id] = self._feeds.get(feed_id), feed
        if old is not None:
            old.close()
        return feed

    def close(self, feed: Feed) -> None:
        with self._lock:
            if self._feeds.get(feed.feed_id) is feed:
                del self._feeds[feed.feed_id]
        feed.close()

    def get(self, feed_id: str) -> Feed | None:
        with self._lock:
            return self._feeds.get(feed_id)

    def close_all(self) -> None:
        with self._lock:
            feeds, self._feeds = list(self._feeds.values()), {}
        for feed in feeds:
            feed.close()

    def flush(self) -> None:
        """Every feed's entries of the step that just ended -> one batch each."""
        with self._lock:
            feeds = list(self._feeds.values())
        for feed in feeds:
            feed.flush()
