"""The decode worker's gRPC face: Reserve, Renew, Start (token stream), Feed (a caller's
tokens of every stream, a message a step: decode/feed.py), Release, Health, Migrate (move a
running request's KV to another decode worker), Shutdown (stop as on SIGTERM: the router's
Drain with stop calls it once nothing is left here)."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

import grpc

from decode.feed import FeedEntry
from decode.streams import BrokenEvent, EndEvent, Stream
from decode.worker import (
    DecodeWorker,
    KVNotArrived,
    MigrationFailed,
    ReservationError,
    UnknownRequest,
)
from pdserve.engine.admission import waiting_per_worker
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.convert import sampling_from_proto, spans_to_proto
from pdserve.serving.destination import destination_from_proto
from pdserve.serving.kv_pool import layout_to_proto, ranks_to_proto
from pdserve.serving.registration import stop_this_process
from pdserve.serving.server import health

log = logging.getLogger(__name__)

STREAM_FAILPOINT_AT = 4  # decode.stream strikes once a stream handed this many tokens over
FEED_POLL_S = 1.0  # a Feed call with nothing to send looks whether its caller is still there


class DecodeService(rpc.DecodeServicer):
    def __init__(
        self, worker: DecodeWorker, on_shutdown: Callable[[], None] = stop_this_process
    ) -> None:
        self.worker = worker
        self.on_shutdown = on_shutdown  # the process's own graceful stop (SIGTERM)

    def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        try:
            params = sampling_from_proto(request.sampling)
            reserved = self.worker.reserve(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                request.lease_s,
                request.push_window_s,
                request.extra_tokens,
                waiting_per_worker(request.line, request.decode_workers),
                request.generated_tokens,
            )
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ReservationError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        endpoint = self.worker.endpoint
        return pb.ReserveResponse(
            block_ids=reserved.block_ids,
            cached_blocks=reserved.cached_blocks,
            headroom_cost_blocks=reserved.headroom_cost,
            layout=layout_to_proto(endpoint.layout),
            agent_metadata=endpoint.agent.metadata(),
            worker_id=self.worker.worker_id,
            fence=reserved.fence,
            ranks=ranks_to_proto(endpoint),
        )

    def Renew(self, request: pb.RenewRequest, context) -> pb.RenewResponse:
        try:
            found = self.worker.renew(request.request_id, request.fence, request.lease_s)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.RenewResponse(found=found)

    def Start(self, request: pb.StartRequest, context):
        worker, rid = self.worker, request.request_id
        feed = None
        if request.feed_id:
            feed = worker.feeds.get(request.feed_id)
            if feed is None:  # the caller's feed broke meanwhile: it opens it again
                context.abort(grpc.StatusCode.ABORTED, f"no feed {request.feed_id!r} open")
        try:
            if request.prefill_here:
                stream = worker.start_here(rid, feed)
            else:
                stream = worker.start(
                    rid,
                    request.first_token,
                    list(request.more_token_ids),
                    request.first_token_sent,
                    feed,
                )
        except UnknownRequest as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:  # a migration's tokens outgrew its reservation (now ended)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except KVNotArrived as e:
            worker.release(rid)
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        context.add_callback(lambda: worker.release(rid))
        produced = 0
        # on a feed its end comes from the sender, which stops when the feed closes: look
        # every FEED_POLL_S whether the call or the feed is gone
        wait_s = worker.config.stream_idle_s if feed is None else FEED_POLL_S
        while True:
            try:
                event = stream.events.get(timeout=wait_s)
            except queue.Empty:
                if feed is not None and not context.is_active():
                    return  # its caller is gone
                if feed is not None and feed.closed:  # nothing more of it reaches the caller
                    worker.release(rid)  # (its caller opened the feed again, or it closes):
                    context.abort(  # told now, not after a grace, it resumes the request
                        grpc.StatusCode.ABORTED, f"its feed {feed.feed_id!r} closed"
                    )
                if worker.is_pending(rid) or (feed is not None and self._fed_lately(stream)):
                    continue  # preempted and waiting for room (recompute or reload): alive
                worker.release(rid)
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "decode produced nothing")
            if feed is not None:  # its end was sent on the feed, or its message failed
                if isinstance(event, BrokenEvent):
                    context.abort(grpc.StatusCode.ABORTED, event.reason)
                return
            worker.metrics.stream_messages.labels("stream").inc()
            if isinstance(event, EndEvent):
                yield self._final(stream, event, stream.produced)
                return
            produced += 1
            yield pb.TokenChunk(token_ids=[event.token])
            if produced == STREAM_FAILPOINT_AT:
                worker.config.failpoints.hit("decode.stream", rid)

    def Feed(self, request: pb.FeedRequest, context):
        if not request.feed_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "feed_id: must not be empty")
        feeds, metrics = self.worker.feeds, self.worker.metrics
        feed = feeds.open(request.feed_id)
        metrics.feeds_open.inc()
        context.add_callback(lambda: feeds.close(feed))  # a cancel ends its wait at once
        try:
            yield pb.FeedBatch()  # open: Starts may name it from now on
            sent = metrics.stream_messages.labels("feed")
            while context.is_active():
                batch = feed.next_batch(FEED_POLL_S)
                if batch is None:  # replaced by a newer feed of the same id, or closed
                    return
                if not batch:
                    continue
                if self.worker.config.failpoints.hit("decode.feed", feed.feed_id) == "error":
                    context.abort(grpc.StatusCode.UNAVAILABLE, "the feed was cut (failpoint)")
                items = [item for entry in batch if (item := self._feed_item(entry)) is not None]
                yield pb.FeedBatch(items=items)
                sent.inc()
                for entry in batch:  # after the message: its tokens are on their way
                    if isinstance(entry.event, EndEvent):
                        if not entry.stream.feed_broken:
                            entry.stream.events.put(entry.event)  # its Start ends OK
                    elif entry.produced == STREAM_FAILPOINT_AT:
                        # (a pause here holds every stream of this feed, not the struck one)
                        self.worker.config.failpoints.hit("decode.stream", entry.stream.request_id)
        finally:  # ended, cancelled or failed
            feeds.close(feed)
            metrics.feeds_open.dec()

    def _feed_item(self, entry: FeedEntry) -> pb.FeedItem | None:
        """A feed entry's message, or None when it cannot be built: then its own Start call
        fails (the request resumes), none of its later entries is sent (no hole in its
        tokens) and the feed goes on for every other stream."""
        event, rid = entry.event, entry.stream.request_id
        if entry.stream.feed_broken:
            return None
        try:
            if isinstance(event, EndEvent):
                chunk = self._final(entry.stream, event, entry.produced)
            else:
                chunk = pb.TokenChunk(token_ids=[event.token])
            return pb.FeedItem(request_id=rid, chunk=chunk)
        except Exception as e:  # noqa: BLE001 - one stream's failure, not the feed's
            log.exception("request %s: its feed message could not be built", rid)
            entry.stream.feed_broken = True
            entry.stream.events.put(BrokenEvent(f"its feed message could not be built: {e}"))
            return None

    def _fed_lately(self, stream: Stream) -> bool:
        """A stream on a feed: its Start call hears of its tokens only through this."""
        return time.monotonic() - stream.last_token < self.worker.config.stream_idle_s

    def _final(self, stream: Stream, event: EndEvent, produced: int) -> pb.TokenChunk:
        """A stream's last message: its last token when its step also ended it, the reason,
        the decode-side TPOT (first token handed over -> last, per later token), spans."""
        tpot = stream.tpot(produced)
        if produced > 1:
            self.worker.metrics.tpot.observe(tpot)
        return pb.TokenChunk(
            token_ids=[] if event.last_token is None else [event.last_token],
            finished=True,
            finish_reason=event.finish_reason,
            tpot_s=tpot,
            spans=spans_to_proto(stream.spans),
        )

    def Migrate(self, request: pb.MigrateRequest, context) -> pb.MigrateResponse:
        try:
            dest = destination_from_proto(request)
            # the caller's deadline counts: the router fences the reservation for it
            moved = self.worker.migrate(
                request.request_id,
                dest,
                request.dest_request_id,
                request.max_rounds,
                context.time_remaining(),
            )
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except MigrationFailed as e:
            # ABORTED: a WRITE may still land, the destination must fence its blocks
            code = grpc.StatusCode.ABORTED if e.wrote else grpc.StatusCode.FAILED_PRECONDITION
            context.abort(code, str(e))
        return pb.MigrateResponse(
            rounds=moved.rounds,
            bytes=moved.nbytes,
            num_tokens=moved.num_tokens,
            stall_s=moved.stall_s,
        )

    def Release(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.worker.release(request.request_id, request.unpushed))

    def Health(self, request, context) -> pb.HealthResponse:
        return health("decode", self.worker.worker_id)

    def Shutdown(self, request, context) -> pb.Empty:
        self.on_shutdown()  # returns at once: the stop runs on the main thread
        return pb.Empty()
