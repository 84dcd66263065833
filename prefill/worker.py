"""The prefill worker: batches prompts under a token budget, runs the prompt forward pass on
the engine core and pushes each layer's KV into the decode worker's reserved blocks as soon
as that layer is computed, overlapping the transfer of layer i with the compute of layer
i + 1 (prefill/push.py).

Block ownership on this side: FREE -reserve-> COMPUTED -push done (or abort/failure)-> FREE.
A prompt whose blocks cannot be reserved waits for the next batch (this batch's blocks are
freed once its push is done); one larger than the whole pool is refused at submit. Prefill
never computes KV with nowhere to go: the decode blocks were reserved before it arrived.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.engine.core import EngineCore
from pdserve.sampling_params import SamplingParams
from pdserve.serving.cpu_lease import open_lease, turn_of
from pdserve.serving.destination import Destination
from pdserve.serving.kv_pool import KVEndpoint, open_endpoint
from pdserve.serving.registration import WorkerStats
from pdserve.trace import Span, now
from prefill.batcher import Batcher, PrefillJob, reserve_batch
from prefill.config import PrefillConfig
from prefill.metrics import PrefillMetrics
from prefill.push import BatchPush, PushTarget
from prefill.turns import TurnBudget
from transfer import (
    Transfer,
    TransferAgent,
    TransferFailed,
    XferState,
    notification,
    unposted_notification,
)
from transfer.writes import Peers, pool_side

RANK_EXTENSION = "prefill.rank:PrefillRank"  # what ranks 1..n-1 run (prefill/rank.py)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    queue_s: float
    prefill_s: float
    transfer_s: float  # push tail: last layer computed -> every layer's write done
    transfer_bytes: int
    spans: tuple[Span, ...] = ()


class PrefillCancelled(RuntimeError):
    """Its caller went away (the call was cancelled) before its prompt was computed: it
    was dropped from the queue, nothing computed or posted."""


class PrefillDeadline(TimeoutError):
    """The caller's deadline passed before the prompt's KV was pushed: nothing more is
    posted for it (DEADLINE_EXCEEDED at the edge)."""


def nothing_posted(e: BaseException) -> bool:
    """Whether a job failed with `e` before any WRITE of it was posted (on any rank): its
    reserved blocks can take no byte of it (the service tells the router, which releases
    them unfenced instead of keeping them out of the pool for the push window)."""
    return getattr(e, "nothing_posted", False)


def _ended(sent: Transfer) -> bool:
    """Whether a note's transfer has ended (then released; a pending one is kept: its
    buffers must outlive it)."""
    try:
        pending = sent.state() is XferState.PENDING
    except Exception:  # noqa: BLE001 - lost track of: over
        pending = False
    if not pending:
        sent.release()
    return not pending


def _fail(job: PrefillJob, e: Exception, posted: bool) -> None:
    """Fail `job` with `e`, told whether any WRITE of it was posted; when none was, with a
    copy of `e` that says so (one error is often every job's of a batch, posted or not).
    An error that cannot be copied (its class takes other arguments) is left as it is:
    the reservation then stays fenced, as for a posted one."""
    if not posted:
        try:
            told = copy.copy(e)
        except Exception:  # noqa: BLE001 - any failure to copy: say nothing
            told = None
        if told is not None:
            told.nothing_posted = True
            told.__cause__, told.__context__ = e.__cause__, e.__context__
            told.__suppress_context__ = e.__suppress_context__  # setting __cause__ set it
            told.__traceback__ = e.__traceback__
            e = told
    job.done.set_exception(e)


class PrefillWorker:
    def __init__(self, core: EngineCore, endpoint: KVEndpoint, config: PrefillConfig) -> None:
        self.core = core
        self.endpoint = endpoint
        self.config = config
        self.worker_id = config.worker_id
        self.local = pool_side(endpoint.agent, endpoint.layout)
        self.metrics = PrefillMetrics()
        self.peers = Peers(endpoint.agent)  # keyed (decode id, its rank)
        self._notes: list[Transfer] = []  # "nothing posted" notes on their way (_unfence)
        cuda = core.kv_pool.device.type == "cuda"
        self.layerwise = config.kv_push == "layerwise" or (config.kv_push == "auto" and cuda)
        self.batcher = Batcher(core.token_budget)
        self.queued_tokens = 0
        self.lock = threading.Lock()  # queued_tokens (submit and heartbeats vs the loop)
        self.cpu_lease = open_lease(config.cpu_lease, core.kv_pool.device.type)
        # in turns at shared CPUs, batches sized by time (prefill/turns.py)
        self.turns = (
            TurnBudget(config.turn_s, core.token_budget)
            if self.cpu_lease is not None and config.turn_s > 0
            else None
        )
        self._thread = threading.Thread(target=self._run, name="prefill-loop", daemon=True)
        self._thread.start()

    @classmethod
    def build(
        cls, model: str, args: EngineArgs, config: PrefillConfig, agent: TransferAgent
    ) -> PrefillWorker:
        """A prefill worker on its own engine, its pool registered with `agent`."""
        core, _ = build_engine(model, args)
        return cls(core, open_endpoint(core, model, agent, RANK_EXTENSION), config)

    def submit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        dest: Destination,
        deadline: float = float("inf"),
        gone: Callable[[], bool] | None = None,
    ) -> Future:
        """Validate and queue a prompt; the future resolves to a PrefillResult, or to
        PrefillDeadline when `deadline` (time.monotonic()) passed before its push was done,
        or to PrefillCancelled when `gone()` (its caller went away) turned true before its
        batch started."""
        self.endpoint.routes_to(dest.pools)  # the handshake: refused before anything queues
        req = self.core.make_request(prompt, params, request_id=request_id)
        if len(dest.block_ids) != self.core.blocks_needed(len(prompt)):
            raise ValueError(
                f"dest_block_ids: {len(dest.block_ids)} blocks for a {len(prompt)}-token prompt"
            )
        if not 0 <= dest.cached_blocks < len(dest.block_ids):
            raise ValueError(
                f"dest_cached_blocks: {dest.cached_blocks} of {len(dest.block_ids)} blocks "
                "(the last block is always pushed)"
            )
        self.config.failpoints.hit("prefill.accept", request_id)
        # a WRITE posted at post_by has until the deadline to land (a quarter of the time
        # given, at most push_timeout_s)
        drain = min(self.config.push_timeout_s, 0.25 * max(0.0, deadline - time.monotonic()))
        job = PrefillJob(req, dest, deadline=deadline, post_by=deadline - drain)
        if gone is not None:
            job.gone = gone
        with self.lock:
            self.queued_tokens += len(prompt)
            self.metrics.queued_tokens.set(self.queued_tokens)
        self.batcher.put(job)
        return job.done

    def stats(self) -> WorkerStats:
        return WorkerStats(
            free_blocks=self.core.free_blocks,
            total_blocks=self.core.num_blocks,
            queued_tokens=self.queued_tokens,
        )

    def check_integrity(self) -> None:
        self.core.check_integrity()

    def close(self) -> None:
        self.batcher.close()
        self._thread.join(timeout=10)
        self.endpoint.close()
        self.core.close()  # the spill tiers of --prefix-offload
        if self.cpu_lease is not None and not self._thread.is_alive():  # else it may be mid-turn
            self.cpu_lease.close()

    # -- the loop -------------------------------------------------------------------------
    def _run(self) -> None:
        """The loop outlives any one batch: a loop that died with one (the first wave's
        did, on an exception class it did not expect) left a worker that heartbeated and
        never completed another prompt."""
        while (batch := self._next_batch()) is not None:
            try:
                self._prefill(batch)
            except Exception as e:  # noqa: BLE001 - fail the batch, keep the worker
                log.exception("the prefill loop caught a failure of a batch of %d", len(batch))
                for job in batch:
                    if not job.done.done():
                        job.done.set_exception(e)

    def _next_batch(self) -> list[PrefillJob] | None:
        if self.turns is not None:
            self.batcher.budget = self.turns.tokens()
            self.metrics.turn_budget_tokens.set(self.batcher.budget)
        return self.batcher.next_batch()

    def _late(self, batch: list[PrefillJob]) -> list[PrefillJob]:
        """Drop the jobs whose caller went away and fail those whose deadline passed while
        they queued -> the others."""
        self._notes = [n for n in self._notes if not _ended(n)]
        t, kept = time.monotonic(), []
        for job in batch:
            if job.post_by <= t:  # (a call past its deadline is no longer active either)
                self._dequeued([job])
                self._unfence(job)
                _fail(job, PrefillDeadline("the caller's deadline passed in the queue"), False)
            elif job.gone():
                self._dequeued([job])
                self.metrics.cancelled.inc()
                self._unfence(job)
                _fail(job, PrefillCancelled("the call was cancelled while it queued"), False)
            else:
                kept.append(job)
        return kept

    def _unfence(self, job: PrefillJob) -> None:
        """Tell the decode worker that no WRITE of `job` was or will be posted: its
        reservation's blocks go back when the router releases it (a cancelled call's
        router never hears that nothing was posted) instead of at the end of the push
        window. Not waited for (a dead decode worker's acknowledgement never comes): the
        note's transfer is kept until it ends, looked at with every batch. Best effort: a
        note that cannot go leaves the window to end the fence, as before."""
        dest = job.dest
        try:
            peer, _ = self.peers.side((dest.worker_id, 0), dest.rank_metadata(0), dest.pools[0])
            note = unposted_notification(job.request.request_id, dest.fence)
            self._notes.append(self.endpoint.agent.notify(peer, note))
        except Exception as e:  # noqa: BLE001 - any failure: the push window ends it
            log.info("could not tell %s that nothing was posted for %s: %s",
                     dest.worker_id, job.request.request_id, e)  # fmt: skip

    def _dequeued(self, jobs: list[PrefillJob]) -> None:
        with self.lock:
            self.queued_tokens -= sum(j.tokens for j in jobs)
            self.metrics.queued_tokens.set(self.queued_tokens)

    def _prefill(self, batch: list[PrefillJob]) -> None:
        runnable = reserve_batch(self.core, self._late(batch), self.batcher)
        if not runnable:
            return
        self._dequeued(runnable)
        self.metrics.batch_tokens.observe(sum(j.tokens for j in runnable))
        started = time.monotonic()
        num_layers = self.core.model_config.num_layers
        push, owners = None, []
        work_sent = False
        ranks_posted: set[int] = set()  # jobs the other ranks posted a WRITE for
        try:
            targets, owners, work = self._plan(runnable)
            push = BatchPush(self.endpoint.agent, self.local, targets, num_layers, self.worker_id)

            def post(layers: range) -> None:
                if layers.start == 0:
                    self._failpoint("prefill.push", runnable)
                push.layers(layers)
                if layers.start == 0:
                    self._failpoint("prefill.posted", runnable)

            on_layer = (lambda i: post(range(i, i + 1))) if self.layerwise else None
            parts, part_spans = self._parts(runnable)  # (tensor parallel: plain passes)
            self._check_deadline(runnable)
            work_sent = work is not None  # sent with the last pass: its answers must be read
            with turn_of(self.cpu_lease):
                began, began_wall = time.monotonic(), now()  # the pass, not its wait
                tokens = self.core.prefill(
                    [j.request for j in runnable], on_layer_done=on_layer, rank_work=work
                )
                took = time.monotonic() - began
            computed, computed_wall = time.monotonic(), now()
            if self.turns is not None:
                self.turns.observe(sum(j.tokens for j in runnable) - parts, took)
            if not self.layerwise:  # every layer in one WRITE per request
                post(range(num_layers))
            push.wait(self.config.push_timeout_s, self.config.push_poll_s)
            abandoned = {owners[i] for i in push.abandoned}
            # a job whose push failed fails alone (its decode worker died, say): the
            # batch's other jobs pushed to other workers and go on
            failed = {owners[i]: why for i, why in push.failed.items()}
            nbytes = push.nbytes
            if work_sent:
                answers = self.core.rank_results()
                work_sent = False
                for answer in answers:
                    ranks_posted.update(answer["posted"])
                for rank, answer in enumerate(answers, 1):
                    if answer["error"] is not None:
                        raise TransferFailed(f"rank {rank}'s push failed: {answer['error']}")
                    abandoned.update(answer["abandoned"])
                    failed.update((job, f"rank {rank}: {why}") for job, why in answer["failed"])
                    nbytes += answer["nbytes"]
            posted = {owners[i] for i in push.posted()} | ranks_posted
            pushed, pushed_wall = time.monotonic(), now()
            shared = [
                *part_spans,
                Span("prefill.compute", began_wall, computed_wall, self.worker_id),
                Span("transfer.tail", computed_wall, pushed_wall, self.worker_id),
                *push.spans(),
            ]
            self.metrics.prefill.observe(computed - started)
            self.metrics.transfer_seconds.labels("sent").observe(pushed - computed)
            self.metrics.transfer_bytes.labels("sent").inc(nbytes)
            for i, (job, token) in enumerate(zip(runnable, tokens)):
                if i in failed:  # ABORTED at the edge: its decode worker, not us
                    _fail(job, TransferFailed(failed[i]), i in posted)
                    continue
                if i in abandoned:
                    late = PrefillDeadline("the caller's deadline passed before the push was done")
                    _fail(job, late, i in posted)
                    continue
                job.done.set_result(
                    PrefillResult(
                        first_token=token,
                        queue_s=began - job.enqueued,  # as the spans: to the last pass
                        prefill_s=computed - began,
                        transfer_s=pushed - computed,
                        transfer_bytes=nbytes // len(runnable),
                        spans=(
                            Span("prefill.queue", job.enqueued_wall, began_wall, self.worker_id),
                            *shared,
                        ),
                    )
                )
        except Exception as e:  # every job of the batch fails with it, typed for the edge
            if not isinstance(e, (TransferFailed, ValueError, PrefillDeadline)):
                log.exception("prefill of a batch of %d failed", len(runnable))
            # the other ranks' answers unread: any of them may have posted for any job
            posted = {owners[i] for i in push.posted()} if push is not None else set()
            for i, job in enumerate(runnable):
                if not job.done.done():
                    _fail(job, e, work_sent or i in (posted | ranks_posted))
        finally:
            if work_sent:  # the batch failed after the step went out: read its answers
                try:
                    self.core.rank_results()
                except Exception:  # noqa: BLE001 - the batch has failed already
                    log.warning("the other ranks' push answers are lost with the batch")
            if push is not None:
                push.release()  # never raises (transfer/nixl_backend.py)
            for job in runnable:  # COMPUTED -> FREE (computed blocks stay in the prefix cache)
                self.core.release(job.request)

    def _parts(self, runnable: list[PrefillJob]) -> tuple[int, list[Span]]:
        """A lone prompt longer than a turn buys is computed a part per turn before its
        last pass, which samples and pushes (prefill/turns.py; under tensor parallelism
        the parts are plain passes on every rank, the ranks' push work goes with the last)
        -> the tokens so computed, and a `prefill.part` span for each part. Its deadline
        is looked at before each part (PrefillDeadline: the batch fails, its blocks go)."""
        if self.turns is None or len(runnable) != 1:
            return 0, []
        req, done, spans = runnable[0].request, 0, []
        while part := self.turns.part(
            req.num_tokens - req.num_computed_tokens, self.core.block_size
        ):
            self._check_deadline(runnable)
            with turn_of(self.cpu_lease):
                began, began_wall = time.monotonic(), now()
                computed = self.core.prefill_part(req, part)
                self.turns.observe(computed, time.monotonic() - began)
                spans.append(Span("prefill.part", began_wall, now(), self.worker_id))
            done += computed
        return done, spans

    @staticmethod
    def _check_deadline(jobs: list[PrefillJob]) -> None:
        """PrefillDeadline once the last moment to post a lone job's push has passed (a
        batch of several is looked at before it forms, `_late`, and pushes what it can)."""
        if len(jobs) == 1 and time.monotonic() >= jobs[0].post_by:
            raise PrefillDeadline("the caller's deadline passed while its prompt was computed")

    def _failpoint(self, point: str, jobs: list[PrefillJob]) -> None:
        if self.config.failpoints.directory is None:
            return
        detail = "\n".join(f"{j.request.request_id} {j.dest.worker_id}" for j in jobs)
        self.config.failpoints.hit(point, detail)

    def _plan(self, jobs: list[PrefillJob]) -> tuple[list[PushTarget], list[int], list | None]:
        """The batch's routes (transfer/heads.py): ours as push targets, with the job each
        belongs to, and the other ranks' as their step work (None without other ranks).
        Every route of a job ends with its own notification, part k of the job's routes."""
        size = self.core.tp_size
        targets, owners = [], []
        work = [self._rank_work() for _ in range(size - 1)] if size > 1 else None
        for i, job in enumerate(jobs):
            dest = job.dest
            pools = dest.pools
            routes = self.endpoint.routes_to(pools)
            skip = dest.cached_blocks  # the blocks the decode worker already holds
            src = job.request.block_ids[skip : len(dest.block_ids)]
            dst = dest.block_ids[skip:]
            for k, route in enumerate(routes):
                heads = self.endpoint.head_route(route, pools)
                notif = notification(job.request.request_id, dest.fence, k, len(routes))
                if route.src == 0:
                    targets.append(self._target(job, route.dst, src, dst, notif, heads))
                    owners.append(i)
                    continue
                work[route.src - 1]["targets"].append(
                    {
                        "job": i,
                        "peer_key": (dest.worker_id, route.dst),
                        "metadata": dest.rank_metadata(route.dst),
                        "pool": pools[route.dst],
                        "src": list(src),
                        "dst": list(dst),
                        "heads": heads,
                        "notif": notif,
                        "post_by": job.post_by,
                        "done_by": job.deadline,
                    }
                )
        return targets, owners, work

    def _rank_work(self) -> dict:
        return {
            "targets": [],
            "layerwise": self.layerwise,
            "num_layers": self.core.model_config.num_layers,
            "timeout_s": self.config.push_timeout_s,
            "poll_s": self.config.push_poll_s,
            "worker": self.worker_id,
        }

    def _target(
        self, job: PrefillJob, rank: int, src: list[int], dst: list[int], notif: bytes, heads
    ) -> PushTarget:
        dest = job.dest
        peer, remote = self.peers.side(
            (dest.worker_id, rank), dest.rank_metadata(rank), dest.pools[rank]
        )
        return PushTarget(
            peer=peer,
            remote=remote,
            src=np.asarray(src),
            dst=np.asarray(dst),
            notif=notif,
            post_by=job.post_by,
            done_by=job.deadline,
            heads=heads,
        )
