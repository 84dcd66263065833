"""Token feeds: a decode worker's tokens for a router on one call, one message a step for
all its streams (decode/feed.py, pdserve/router/feed.py). The books of a feed and a
subscription with exact expectations, then launched clusters (real processes, real
sockets): the colocated engine's tokens with the feed on and off, fewer messages than
tokens on it, and a feed cut with its worker alive (a failpoint): every request resumed
with nothing lost or repeated, every block back, and the feed open again."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest

from decode.feed import Feed, FeedEntry, Feeds
from decode.service import DecodeService
from decode.streams import BrokenEvent, EndEvent, Stream, TokenEvent
from pdserve import failpoints
from pdserve.client import Client
from pdserve.launch import Cluster
from pdserve.router import feed as feed_module
from pdserve.router.feed import FeedLost, RouterFeeds, Subscription
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.server import start_server
from tests.test_cluster import PROMPTS, colocated, wait_all_blocks_free
from tests.test_local_prefill import metric


def _stream(feed: Feed, rid: str) -> Stream:
    return Stream("d", feed=feed, request_id=rid)


def _batch(feed: Feed) -> list[tuple[str, object, int]]:
    batch = feed.next_batch(0.0)
    assert batch is not None
    return [(e.stream.request_id, e.event, e.produced) for e in batch]


def test_a_feed_sends_a_step_in_one_batch_and_an_end_at_once_after_what_came_before():
    feed = Feed("r")
    a, b = _stream(feed, "a"), _stream(feed, "b")
    a.token(1)
    b.token(2)
    assert feed.next_batch(0.0) == []  # nothing until the step ends
    assert a.events.empty() and b.events.empty()  # tokens go to the feed only
    feed.flush()
    assert _batch(feed) == [("a", TokenEvent(1), 1), ("b", TokenEvent(2), 1)]
    feed.flush()
    assert feed.next_batch(0.0) == []  # a flush with nothing pending sends nothing
    a.token(3)
    b.end("length", last_token=4)  # an end goes at once, with what waited before it
    assert _batch(feed) == [("a", TokenEvent(3), 2), ("b", EndEvent("length", 4), 2)]
    assert b.events.empty()  # its Start hears of it once the feed's sender sent it
    assert a.produced == 2 and b.produced == 2
    feed.close()
    a.token(5)  # its caller is gone: dropped, never queued
    feed.flush()
    assert feed.next_batch(0.0) is None


def test_a_stream_without_a_feed_keeps_one_event_a_token():
    s = Stream("d")
    s.token(7)
    s.end("stop")
    assert [s.events.get_nowait(), s.events.get_nowait()] == [TokenEvent(7), EndEvent("stop")]
    assert s.produced == 1


def test_a_feed_opened_again_under_its_id_replaces_the_old_one():
    feeds = Feeds()
    old = feeds.open("r")
    assert feeds.get("r") is old
    new = feeds.open("r")
    assert feeds.get("r") is new and old.closed and old.next_batch(0.0) is None
    feeds.close(old)  # the old call's own cleanup leaves the new one in place
    assert feeds.get("r") is new
    s = _stream(new, "x")
    s.token(1)
    feeds.flush()
    assert _batch(new) == [("x", TokenEvent(1), 1)]
    feeds.close(new)
    assert feeds.get("r") is None and new.closed


def _generate(client: Client, prompts, **kw):
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(
            pool.map(
                lambda p: client.generate(p, max_tokens=10, temperature=0, ignore_eos=True, **kw),
                prompts,
            )
        )


@pytest.mark.parametrize("feed", [True, False])
def test_a_cluster_streams_the_colocated_engines_tokens_with_the_feed_on_or_off(feed, tmp_path):
    """Prompts on the prefill worker and on the decode worker (short ones), concurrently.
    With the feed on, its call is then cut mid-stream with the worker alive (a failpoint,
    UNAVAILABLE): the router cancels the Starts it carried (their blocks come back) and
    resumes them; the clients get the colocated engine's tokens, nothing lost or repeated,
    and the next requests go through a feed opened again."""
    points = str(tmp_path)
    expected = colocated("tiny-llama")
    with Cluster(
        "tiny-llama",
        1,
        1,
        worker_args=["--num-kv-blocks", "64"],
        local_prefill_tokens=20,
        decode_args=["--failpoints", points],
        router_args=[] if feed else ["--no-token-feed"],
    ) as cluster:
        decode = cluster.metrics["decode-0"]
        with Client(cluster.address) as client:
            # the request that opens the feed waits for it; others meanwhile go plain
            first = client.generate(PROMPTS[0], max_tokens=3, temperature=0, ignore_eos=True)
            assert first.token_ids == expected[0][:3]
            plain_before = _by_path(decode)["stream"]
            results = _generate(client, PROMPTS)
            assert [r.token_ids for r in results] == expected
            assert all(r.finish_reason == "length" and r.timings["tpot_s"] > 0 for r in results)
            wait_all_blocks_free(client)
            tokens = sum(len(r.token_ids) for r in [first, *results])
            by_path = _by_path(decode)
            if not feed:
                assert by_path["feed"] == 0
                assert by_path["stream"] == tokens  # a message a token, the last with the end
                assert metric(decode, "pdserve_decode_feeds_open") == 0
                return
            # every request once the feed is open; the first one too, unless its wait for
            # the feed to open ran out (then a plain stream, as designed)
            assert by_path["stream"] == plain_before and plain_before in (0, len(first.token_ids))
            # a message a step for every stream: fewer than a message a token
            assert 0 < by_path["feed"] < tokens, (by_path, tokens)
            assert metric(decode, "pdserve_decode_feeds_open") == 1
            failpoints.arm(points, "any", "decode.feed", "error")
            cut = _generate(client, PROMPTS)
            assert failpoints.fired(points, "any", "decode.feed") is not None
            assert [r.token_ids for r in cut] == expected
            assert sum(r.timings["resumes"] for r in cut) >= 1
            wait_all_blocks_free(client)
            again = _generate(client, PROMPTS)
            assert [r.token_ids for r in again] == expected
            assert sum(r.timings["resumes"] for r in again) == 0
            wait_all_blocks_free(client)
        assert metric(decode, "pdserve_decode_feeds_open") == 1


def _by_path(decode: str) -> dict[str, float]:
    name = "pdserve_decode_stream_messages_total"
    return {path: metric(decode, name, path=path) for path in ("feed", "stream")}


def test_a_worker_without_feed_gets_plain_streams_and_is_not_asked_again():
    """An older decode worker (or a fake) answers Feed UNIMPLEMENTED: the router's client
    says so once (None: plain Start streams) and does not open a call for every request."""
    add = lambda s: rpc.add_DecodeServicer_to_server(rpc.DecodeServicer(), s)  # noqa: E731
    server, port = start_server(add, "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        worker = SimpleNamespace(worker_id="old", stub=rpc.DecodeStub(channel))
        feeds = RouterFeeds()
        assert feeds.subscribe(worker, "r1") is None
        client = feeds._clients[id(worker)]
        assert client.state == "unsupported"
        assert feeds.subscribe(worker, "r2") is None and client._call is None
        assert RouterFeeds(enabled=False).subscribe(worker, "r3") is None
        feeds.close()
    finally:
        channel.close()
        server.stop(None)


class _FakeCall(grpc.RpcError):
    """A Start call as the router's Subscription sees it."""

    def __init__(self) -> None:
        self.callbacks, self.cancelled, self._code = [], False, None

    def add_done_callback(self, callback) -> None:
        if self._code is not None:  # as gRPC does for a call that ended already
            callback(self)
        else:
            self.callbacks.append(callback)

    def end(self, code: grpc.StatusCode) -> None:
        self._code = code
        for callback in self.callbacks:
            callback(self)

    def code(self) -> grpc.StatusCode:
        return self._code

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def _subscription() -> Subscription:
    return Subscription(SimpleNamespace(feed_id="r", unsubscribe=lambda sub: None), "x")


def test_a_start_that_ends_before_its_final_feed_item_still_gets_it_within_the_grace(
    monkeypatch,
):
    sub, call = _subscription(), _FakeCall()
    chunks = sub.chunks(call, timeout_s=30)
    sub.queue.put(pb.TokenChunk(token_ids=[1]))
    assert next(chunks).token_ids == [1]
    call.end(grpc.StatusCode.OK)  # the Start returned before the feed sent the end
    sub.queue.put(pb.TokenChunk(token_ids=[2], finished=True, finish_reason="length"))
    assert [c.token_ids for c in chunks] == [[2]]  # and then the chunks end
    monkeypatch.setattr(feed_module, "END_GRACE_S", 0.05)
    sub, call = _subscription(), _FakeCall()
    chunks = sub.chunks(call, timeout_s=30)
    call.end(grpc.StatusCode.OK)
    assert list(chunks) == []  # no end within the grace: no final chunk (the relay resumes)


def test_a_failed_start_or_a_lost_feed_is_raised_and_a_lost_feed_cancels_the_start():
    sub, call = _subscription(), _FakeCall()
    chunks = sub.chunks(call, timeout_s=30)
    call.end(grpc.StatusCode.UNAVAILABLE)  # the worker died
    with pytest.raises(grpc.RpcError) as e:
        next(chunks)
    assert e.value is call and not call.cancelled
    sub, call = _subscription(), _FakeCall()
    chunks = sub.chunks(call, timeout_s=30)
    sub.queue.put(FeedLost("the feed broke"))
    with pytest.raises(FeedLost) as e:
        next(chunks)
    assert call.cancelled  # the worker releases the request; the relay resumes it
    assert e.value.code() is grpc.StatusCode.ABORTED  # a resume, its worker not suspected
    # the worker died: its feed broke first, its Start failed a moment after; the Start's
    # UNAVAILABLE is raised (the router suspects the worker), not the feed's ABORTED
    sub, call = _subscription(), _FakeCall()
    chunks = sub.chunks(call, timeout_s=30)
    sub.queue.put(FeedLost("the feed broke"))
    threading.Timer(0.05, call.end, (grpc.StatusCode.UNAVAILABLE,)).start()
    with pytest.raises(grpc.RpcError) as e:
        next(chunks)
    assert e.value is call and not call.cancelled
    sub, call = _subscription(), _FakeCall()
    assert list(sub.chunks(call, timeout_s=0.05)) == [] and call.cancelled  # its deadline


def test_each_worker_record_has_its_own_feed_client_and_replaced_ones_close_once_unused():
    feeds = RouterFeeds()
    old = SimpleNamespace(worker_id="d", stub=None)  # closed: plain streams
    assert feeds.subscribe(old, "a") is None
    old_client = feeds._clients[id(old)]
    old_client._subs["busy"] = object()  # a request still streaming through the old record
    new = SimpleNamespace(worker_id="d", stub=None)  # it registered again elsewhere
    assert feeds.subscribe(new, "b") is None
    assert set(feeds._clients) == {id(old), id(new)}  # a stale record never takes the new one's
    old_client._subs.clear()
    newer = SimpleNamespace(worker_id="d", stub=None)
    assert feeds.subscribe(newer, "c") is None
    assert set(feeds._clients) == {id(newer)}  # the unused ones closed
    assert old_client.state == "unsupported"
    feeds.forget("d")
    assert feeds._clients == {}


def test_a_feed_entry_that_cannot_be_built_fails_its_own_start_and_drops_its_later_entries():
    """One stream's message fails (here its spans are not spans): its Start call is told
    (BrokenEvent: ABORTED, the router resumes it), its later tokens and end are never sent
    (no hole in what its client got), and another stream's entries of the same batch go."""
    metrics = SimpleNamespace(tpot=SimpleNamespace(observe=lambda seconds: None))
    service = DecodeService(SimpleNamespace(metrics=metrics), on_shutdown=lambda: None)
    feed = Feed("r")
    bad, good = _stream(feed, "bad"), _stream(feed, "good")
    bad.token(1)
    good.token(2)
    bad.spans.append("not a span")
    bad.end("length", last_token=3)
    entries = feed.next_batch(0.0)
    assert [service._feed_item(e) is None for e in entries] == [False, False, True]
    assert bad.feed_broken and isinstance(bad.events.get_nowait(), BrokenEvent)
    assert service._feed_item(FeedEntry(bad, TokenEvent(4), 3)) is None
    item = service._feed_item(FeedEntry(good, EndEvent("stop", 5), 2))
    assert item.request_id == "good" and item.chunk.finished and list(item.chunk.token_ids) == [5]


class _Aborted(Exception):
    pass


class _Context:
    """A Start call's server context: active until told, abort raises."""

    def __init__(self) -> None:
        self.active = True

    def add_callback(self, callback) -> None:
        pass

    def is_active(self) -> bool:
        return self.active

    def abort(self, code, details):
        raise _Aborted(code, details)


@pytest.mark.parametrize("ended", [False, True], ids=["running", "ended"])
def test_a_start_whose_feed_closed_fails_aborted_at_its_next_look(monkeypatch, ended):
    """A Start bound to a feed that closed (its caller opened the feed again under the same
    id, or is going): whatever the stream does next cannot reach the caller, so the call
    fails ABORTED (the router resumes it) and the request is released here, at the next
    look, not after a grace (an ended stream's Start used to end OK: the router waited 10
    s for an end that never came) nor when a running one runs dry."""
    monkeypatch.setattr("decode.service.FEED_POLL_S", 0.05)
    feeds = Feeds()
    feed = feeds.open("router-1")
    stream = _stream(feed, "r")
    released, started = [], threading.Event()

    def start(*args):
        started.set()
        return stream

    worker = SimpleNamespace(
        feeds=feeds,
        start=start,
        release=released.append,
        is_pending=lambda rid: False,
        config=SimpleNamespace(stream_idle_s=60.0),
    )
    service = DecodeService(worker, on_shutdown=lambda: None)
    context = _Context()
    call = service.Start(
        pb.StartRequest(request_id="r", first_token=1, feed_id="router-1"), context
    )
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(next, call)  # the call runs: bound to the feed open now
        assert started.wait(10)
        stream.token(2)  # it is producing: alive
        feeds.open("router-1")  # the caller opened its feed again: this one closed
        closed = time.monotonic()
        if ended:
            stream.end("length", last_token=3)  # dropped: the feed was closed
        with pytest.raises(_Aborted) as failed:
            first.result(30)
    assert failed.value.args == (grpc.StatusCode.ABORTED, "its feed 'router-1' closed")
    assert time.monotonic() - closed < 5 and released == ["r"]


class _FeedCall:
    """A Feed call as the router's reader sees it: `items` come out, then `error` raises."""

    def __init__(self, items, error: Exception) -> None:
        self.items, self.error = iter(items), error

    def __iter__(self):
        return self

    def __next__(self):
        for item in self.items:
            return item
        raise self.error

    def cancel(self) -> bool:
        return True


def test_a_feed_reader_that_dies_of_any_error_ends_its_feed_at_once():
    """Through the auth interceptor a call made on a closed channel raises its ValueError on
    the first read, not where it was made; the reader used to die of it (only RpcError was
    caught): the opener waited FEED_OPEN_S, and an open feed's subscribers never heard."""
    calls = [_FeedCall([], ValueError("Cannot invoke RPC on closed channel!"))]
    worker = SimpleNamespace(worker_id="w", stub=SimpleNamespace(Feed=lambda req: calls.pop()))
    feeds = RouterFeeds()
    started = time.monotonic()
    assert feeds.subscribe(worker, "a") is None  # plain stream, at once
    assert time.monotonic() - started < feed_module.FEED_OPEN_S / 2
    client = feeds._clients[id(worker)]
    assert client.state == "broken" and client._call is None
    opened = threading.Event()
    calls.append(_FeedCall([pb.FeedBatch()], RuntimeError("boom")))
    real_read = client._read

    def read_after_subscribing(call, event):  # the feed opens, then its reader dies
        def hold(batches):
            yield next(batches)
            opened.wait(5)
            yield from batches

        call.items = hold(call.items)
        real_read(call, event)

    client._read = read_after_subscribing
    threading.Timer(0.2, opened.set).start()
    sub = feeds.subscribe(worker, "b")
    assert sub is not None
    with pytest.raises(FeedLost, match="RuntimeError: boom"):
        next(sub.chunks(_FakeCall(), timeout_s=5))
    assert client.state == "broken" and client.idle
    feeds.close()


def test_a_final_message_past_4_mib_reaches_the_router_and_the_client():
    """A final carries the request's trace (a span a decode step, ~60 bytes, before step
    spans were folded past 256: past gRPC's default 4 MiB receive limit at ~70k tokens;
    still reachable by a request moved many times). The router's channels to its workers and
    the SDK's to the router take what the servers take (on a feed one message too large
    would have ended every request on it)."""
    from pdserve.router.registry import WorkerRecord, grpc_connect
    from pdserve.serving.registration import WorkerStats

    spans = [pb.Span(name="decode.step", start=1.0, end=2.0, worker="decode-28047-1c1be1")] * 90_000
    final = pb.TokenChunk(token_ids=[7], finished=True, finish_reason="length", spans=spans)
    assert final.ByteSize() > 4 << 20

    class Decode(rpc.DecodeServicer):
        def Feed(self, request, context):
            yield pb.FeedBatch()
            yield pb.FeedBatch(items=[pb.FeedItem(request_id="r", chunk=final)])

    class Router(rpc.RouterServicer):
        def Generate(self, request, context):
            yield pb.GenerateResponse(
                request_id="r", token_ids=[7], finished=True, finish_reason="length",
                trace=spans,
            )  # fmt: skip

    servers = [
        start_server(lambda s: rpc.add_DecodeServicer_to_server(Decode(), s), "127.0.0.1", 0),
        start_server(lambda s: rpc.add_RouterServicer_to_server(Router(), s), "127.0.0.1", 0),
    ]
    (decode, dport), (router, rport) = servers
    stats = WorkerStats(free_blocks=1, total_blocks=1, running=0)
    record = WorkerRecord("decode-0", "decode", f"127.0.0.1:{dport}", "", stats)
    channel, stub = grpc_connect(record)
    try:
        batches = list(stub.Feed(pb.FeedRequest(feed_id="f"), timeout=30))
        assert batches[1].items[0].chunk.finished and len(batches[1].items[0].chunk.spans) == 90_000
        with Client(f"127.0.0.1:{rport}") as client:
            out = client.generate([1, 2, 3], max_tokens=1)
        assert out.token_ids == [7] and len(out.trace) == 90_000
    finally:
        channel.close()
        decode.stop(None)
        router.stop(None)
