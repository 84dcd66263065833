"""Each decode worker's feed for this router (decode/feed.py): one long call per worker that
carries every step's tokens of all the streams this router started there, one message a
step, instead of a message a token on each stream.

A request's Start names the feed; its tokens and its end then come through it, and its
Start call carries no message: the call still fails when the worker dies and is cancelled
to abort (pdserve/router/handoff.py relays a Subscription's chunks exactly as it relays a
stream's). A worker whose Feed is unimplemented (an older worker, a test's fake) gets plain streams
from then on (an upgrade in place is not noticed until it registers again); so does a
request while its worker's feed is opening (only the request that opens it waits, at most
FEED_OPEN_S) or when its channel is closed. A feed that breaks fails every request it
carried (ABORTED: they resume; its worker is not suspected, since it may be alive) and
opens again on next use.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator

import grpc

from pdserve.router.registry import Worker
from pdserve.rpc import pdserve_pb2 as pb

log = logging.getLogger(__name__)

FEED_OPEN_S = 5.0  # a feed's first message within this, or plain streams this time
END_GRACE_S = 10.0  # a Start call ended OK: its end is on the feed within this
LOST_LOOK_S = 0.25  # a feed broke: how long its Start calls' own status is waited for


class FeedLost(grpc.RpcError):
    """The feed that carried a request's tokens broke: a retry (a resume) can help."""

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.ABORTED

    def details(self) -> str:
        return self._details


_START_DONE = object()  # the request's Start call ended (OK or not)


class Subscription:
    """One request's chunks as its worker's feed delivers them."""

    def __init__(self, client: FeedClient, request_id: str) -> None:
        self.client, self.request_id = client, request_id
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    @property
    def feed_id(self) -> str:
        return self.client.feed_id

    def chunks(self, call, timeout_s: float) -> Iterator[pb.TokenChunk]:
        """The request's chunks up to its final one, while `call` (its Start, which names
        this feed) runs. Raises the call when it fails (it is a grpc.RpcError), FeedLost when
        the feed broke (the call is cancelled: the worker releases the request); ends
        without a final chunk when the call ended OK but no end came within END_GRACE_S."""
        call.add_done_callback(lambda _: self.queue.put(_START_DONE))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                item = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                call.cancel()
                return
            if item is _START_DONE:
                if call.code() is not grpc.StatusCode.OK:
                    raise call
                deadline = min(deadline, time.monotonic() + END_GRACE_S)
            elif isinstance(item, FeedLost):
                # a worker that died takes its feed and its Start call down together; the
                # Start's own status says so (UNAVAILABLE: the router suspects it), where
                # the feed alone cannot tell a dead worker from a cut feed
                with contextlib.suppress(queue.Empty):  # its Start's own end, if it comes
                    ended = self.queue.get(timeout=LOST_LOOK_S) is _START_DONE
                    if ended and call.code() is not grpc.StatusCode.OK:
                        raise call
                call.cancel()
                raise item
            else:
                yield item
                if item.finished:
                    return

    def close(self) -> None:
        self.client.unsubscribe(self)


class FeedClient:
    """This router's feed from one decode worker (one Worker record: a worker that
    registers again at another address gets a new client)."""

    def __init__(self, worker: Worker, feed_id: str) -> None:
        self.worker, self.feed_id = worker, feed_id
        self._lock = threading.Lock()
        self._subs: dict[str, Subscription] = {}
        self._call = None
        self._opened = threading.Event()
        # "new" -> "opening" -> "open"; "broken" (opens again on next use); "unsupported"
        self.state = "new"

    def subscribe(self, request_id: str) -> Subscription | None:
        """Before the request's Start: its chunks from the feed, or None (plain stream)."""
        with self._lock:
            if self.state in ("unsupported", "opening") or self.worker.stub is None:
                return None
            if self.state in ("new", "broken"):
                try:
                    self._open()
                except ValueError:  # its channel was closed: the worker is gone
                    self.state = "broken"
                    return None
            opened = self._opened
            sub = self._subs[request_id] = Subscription(self, request_id)
        opened.wait(FEED_OPEN_S)
        with self._lock:  # still this call's, open, and still registered: else plain
            if (
                self._opened is opened
                and self.state == "open"
                and self._subs.get(request_id) is sub
            ):
                return sub
        self.unsubscribe(sub)
        return None

    @property
    def idle(self) -> bool:
        return not self._subs

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if self._subs.get(sub.request_id) is sub:
                del self._subs[sub.request_id]

    def close(self) -> None:
        with self._lock:
            call, self._call, self.state = self._call, None, "unsupported"
        if call is not None:
            call.cancel()

    def _open(self) -> None:
        """(Under the lock.) The call is cancelled by close() and fails with the worker's
        channel: it has no deadline of its own."""
        call = self.worker.stub.Feed(pb.FeedRequest(feed_id=self.feed_id))
        self._call, self._opened, self.state = call, threading.Event(), "opening"
        threading.Thread(
            target=self._read,
            args=(call, self._opened),
            name=f"router-feed-{self.worker.worker_id}",
            daemon=True,
        ).start()

    def _read(self, call, opened: threading.Event) -> None:
        code, details = None, "the feed ended"
        try:
            for batch in call:
                if not opened.is_set():  # its first message: the worker holds it open
                    with self._lock:
                        if self._call is call:
                            self.state = "open"
                    opened.set()
                    continue
                for item in batch.items:
                    sub = self._subs.get(item.request_id)
                    if sub is not None:
                        sub.queue.put(item.chunk)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or e.code().name
        except Exception as e:  # noqa: BLE001 -- whatever ends the reader ends the feed
            # (a call made on a closed channel through the auth interceptor raises its
            # ValueError here, on the first read, not where it was made)
            details = f"{type(e).__name__}: {e}"
            call.cancel()  # the worker's sender ends too, not left blocked on this call
        with self._lock:
            was_open = opened.is_set()
            if self._call is call:
                never = not was_open and code is grpc.StatusCode.UNIMPLEMENTED
                self.state = "unsupported" if never else "broken"
                self._call = None
            subs, self._subs = list(self._subs.values()), {}
        opened.set()  # a subscriber waiting for it sees that it did not open: plain stream
        if not was_open:  # nobody was given a subscription of it
            return
        if subs:
            log.warning("feed of %s broke (%s): %d requests resume", self.worker.worker_id,
                        details, len(subs))  # fmt: skip
        lost = FeedLost(f"decode worker {self.worker.worker_id}'s feed broke: {details}")
        for sub in subs:
            sub.queue.put(lost)


class RouterFeeds:
    """Every decode worker's FeedClient, under this router's feed id: one per Worker record
    (a request still holding the record of a worker that registered again since uses that
    record's own client, never the new one's)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.feed_id = f"router-{uuid.uuid4().hex[:12]}"
        self._clients: dict[int, FeedClient] = {}  # by id() of the Worker (held: no reuse)
        self._lock = threading.Lock()

    def subscribe(self, worker: Worker, request_id: str) -> Subscription | None:
        if not self.enabled:
            return None
        stale = []
        with self._lock:
            client = self._clients.get(id(worker))
            if client is None:
                client = self._clients[id(worker)] = FeedClient(worker, self.feed_id)
                # the records this one replaced (it registered again): once unused, closed
                stale = [
                    k
                    for k, c in self._clients.items()
                    if c.worker.worker_id == worker.worker_id and c is not client and c.idle
                ]
                stale = [self._clients.pop(k) for k in stale]
        for old in stale:
            old.close()
        return client.subscribe(request_id)

    def forget(self, worker_id: str) -> None:
        """The worker left the registry: its records' feeds close."""
        with self._lock:
            gone = [k for k, c in self._clients.items() if c.worker.worker_id == worker_id]
            clients = [self._clients.pop(k) for k in gone]
        for client in clients:
            client.close()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
