"""The prefill worker: batches prompts under a token budget, runs the prompt forward pass and
pushes each layer's KV into the decode worker's reserved blocks as soon as that layer is
computed, overlapping the transfer of layer i with the compute of layer i + 1.

Block ownership on this side: FREE -prefill-> COMPUTED -push done (or abort/failure)-> FREE.
A prompt whose blocks cannot be allocated waits for the next batch (this batch's blocks are
freed once its push is done); one larger than the whole pool is refused at submit. Prefill
never computes KV with nowhere to go: the decode blocks were reserved before it arrived.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from pdserve.engine.args import EngineArgs
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.sampling_params import SamplingParams
from pdserve.serving.kv_endpoint import (
    PoolGeometry,
    PoolSide,
    block_runs,
    kv_endpoint,
    write_layers,
)
from pdserve.serving.metrics import PrefillMetrics
from pdserve.trace import Span, now
from transfer import Tiles, Transfer, TransferFailed, XferState, check_handshake

PUSH_TIMEOUT_S = 30.0
KV_PUSH = ("auto", "layerwise", "after")


@dataclass(frozen=True)
class Destination:
    worker_id: str
    agent_metadata: bytes
    block_ids: list[int]
    wire_version: int
    layout_hash: str
    geometry: PoolGeometry  # of the decode worker's pool
    region: int  # the decode pool's region id in its agent
    cached_blocks: int = 0  # leading blocks the decode worker already holds: not pushed


@dataclass
class PrefillJob:
    request: Request
    dest: Destination
    done: Future = field(default_factory=Future)  # -> PrefillResult
    enqueued: float = field(default_factory=time.monotonic)
    enqueued_wall: float = field(default_factory=now)


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    queue_s: float
    prefill_s: float
    transfer_s: float  # push tail: last layer computed -> every layer's write done
    transfer_bytes: int
    spans: tuple[Span, ...] = ()


class LayerPushes:
    """Each push's writes (one layer, or all layers at once) with the wall-clock time they
    were posted and first seen complete (polled at every later layer boundary and while
    waiting for the tail)."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.layers: list[tuple[int, float, list[Transfer]]] = []  # (layer or -1 for all, ...)
        self.done_at: dict[int, float] = {}

    def posted(self, layers: range, transfers: list[Transfer]) -> None:
        self.layers.append((layers.start if len(layers) == 1 else -1, now(), transfers))
        self.poll()

    def poll(self) -> bool:
        """True when every posted write is complete; raises TransferFailed on a failed one."""
        for layer, _, transfers in self.layers:
            if layer in self.done_at:
                continue
            states = [t.state() for t in transfers]
            if XferState.FAILED in states:
                raise TransferFailed(f"the push of layer {layer} failed")
            if all(s is XferState.DONE for s in states):
                self.done_at[layer] = now()
        return len(self.done_at) == len(self.layers)

    def wait(self, timeout_s: float = PUSH_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.poll():
            if time.monotonic() > deadline:
                raise TransferFailed(f"KV push not complete after {timeout_s}s")
            time.sleep(0.0001)

    def spans(self) -> list[Span]:
        return [
            Span(
                "push.layer" if layer >= 0 else "push.all",
                start,
                self.done_at[layer],
                self.worker,
                layer,
            )
            for layer, start, _ in self.layers
        ]

    def all(self) -> list[Transfer]:
        return [t for _, _, transfers in self.layers for t in transfers]


class PrefillWorker:
    def __init__(
        self, model: str, worker_id: str, transfer: str, args: EngineArgs, kv_push: str = "auto"
    ) -> None:
        if kv_push not in KV_PUSH:
            raise ValueError(f"kv_push: {kv_push!r} is not one of {', '.join(KV_PUSH)}")
        self.engine = LLMEngine(model, args)
        self.worker_id = worker_id
        endpoint = kv_endpoint(self.engine, model, worker_id, transfer)
        self.geometry, self.layout = endpoint.geometry, endpoint.layout
        self.agent, self.region = endpoint.agent, endpoint.region
        self.tiles = self.agent.prepare_tiles(None, self.region, self.geometry.block_bytes)
        self.metrics = PrefillMetrics()
        self.peers: dict[str, tuple[str, Tiles]] = {}  # decode id -> (peer name, its pool tiles)
        self.budget = args.max_num_batched_tokens
        # Push each layer as soon as it is computed, or every layer in one WRITE after the
        # forward pass. "auto" is layer-wise on CUDA, where copy engines and the NIC move
        # bytes while the SMs compute; on CPU the push competes with the forward pass for the
        # same cores and measured no gain, while 30 small WRITEs cost more than one
        # (docs/benchmarks.md, bench transfer).
        cuda = self.engine.kv_cache.pool.device.type == "cuda"
        self.layerwise = kv_push == "layerwise" or (kv_push == "auto" and cuda)
        self.jobs: queue.Queue[PrefillJob | None] = queue.Queue()
        self._carry: list[PrefillJob] = []  # jobs that waited for blocks, first in the next batch
        self.queued_tokens = 0
        self.lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="prefill-loop", daemon=True)
        self._thread.start()

    def submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, dest: Destination
    ) -> Future:
        """Validate and queue a prompt; the future resolves to a PrefillResult."""
        check_handshake(self.layout, dest.wire_version, dest.layout_hash)
        req = self.engine.make_request(prompt, params)
        req.request_id = request_id
        if len(dest.block_ids) != self.engine.allocator.blocks_needed(len(prompt)):
            raise ValueError(
                f"dest_block_ids: {len(dest.block_ids)} blocks for a {len(prompt)}-token prompt"
            )
        if not 0 <= dest.cached_blocks < len(dest.block_ids):
            raise ValueError(
                f"dest_cached_blocks: {dest.cached_blocks} of {len(dest.block_ids)} blocks "
                "(the last block is always pushed)"
            )
        job = PrefillJob(req, dest)
        with self.lock:
            self.queued_tokens += len(prompt)
            self.metrics.queued_tokens.set(self.queued_tokens)
        self.jobs.put(job)
        return job.done

    def stats(self) -> dict:
        alloc = self.engine.allocator
        return {
            "queued_tokens": self.queued_tokens,
            "free_blocks": alloc.num_free_blocks,
            "total_blocks": alloc.num_blocks,
        }

    def check_integrity(self) -> None:
        self.engine.allocator.check_integrity({})

    def close(self) -> None:
        self.jobs.put(None)
        self._thread.join(timeout=10)
        self.agent.close()
        self.engine.close()  # the spill tiers of --prefix-offload

    # -- the loop -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            first = self._carry.pop(0) if self._carry else self.jobs.get()
            if first is None:
                return
            batch, tokens = [first], len(first.request.token_ids)
            while self._carry and tokens < self.budget:  # jobs that waited for blocks go first
                batch.append(self._carry.pop(0))
                tokens += len(batch[-1].request.token_ids)
            while tokens < self.budget:  # more prompts that fit the token budget
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self.jobs.put(None)
                    break
                batch.append(job)
                tokens += len(job.request.token_ids)
            self._prefill(batch)

    def _prefill(self, batch: list[PrefillJob]) -> None:
        alloc = self.engine.allocator
        runnable = []
        for job in batch:
            req = job.request
            if not alloc.can_allocate(req.token_ids):
                # submit() admits only prompts that fit the whole pool, and every batch frees
                # its blocks, so this prompt fits once the jobs ahead of it are done
                assert runnable, "a lone prompt must fit the empty pool"
                self._carry.append(job)
                continue
            req.block_ids, cached = alloc.allocate(req.token_ids)
            if self.engine.prefixes is not None:  # offloaded prefix blocks come back
                cached = self.engine.prefixes.extend(req.token_ids, req.block_ids, cached)
            req.num_computed_tokens = cached
            runnable.append(job)
            with self.lock:
                self.queued_tokens -= len(req.token_ids)
                self.metrics.queued_tokens.set(self.queued_tokens)
        if not runnable:
            return
        self.metrics.batch_tokens.observe(sum(len(j.request.token_ids) for j in runnable))
        started, started_wall = time.monotonic(), now()
        pushes = LayerPushes(self.worker_id)
        nbytes = [0]
        try:
            peers = [self._peer(job.dest) for job in runnable]
            chunks = [self._chunk(job.request) for job in runnable]

            # the blocks after those the decode worker already holds
            blocks = [
                (
                    np.asarray(j.request.block_ids[j.dest.cached_blocks : len(j.dest.block_ids)]),
                    np.asarray(j.dest.block_ids[j.dest.cached_blocks :]),
                )
                for j in runnable
            ]
            runs = [block_runs(src, dst) for src, dst in blocks]

            def push(layers: range) -> None:
                last = layers.stop == self.engine.model_config.num_layers
                posted: list[Transfer] = []
                for job, (peer, tiles), (src, dst), r in zip(runnable, peers, blocks, runs):
                    notif = job.request.request_id.encode() if last else b""
                    posted.append(
                        write_layers(
                            self.agent,
                            peer,
                            layers,
                            PoolSide(self.geometry, self.region, self.tiles),
                            PoolSide(job.dest.geometry, job.dest.region, tiles),
                            (src, dst, r),
                            notif,
                        )
                    )
                    nbytes[0] += (
                        len(layers)
                        * src.size
                        * self.geometry.planes_per_layer
                        * self.geometry.block_bytes
                    )
                pushes.posted(layers, posted)

            layerwise = self.layerwise
            tokens, _ = self.engine.runner.execute(
                chunks, on_layer_done=(lambda x: push(range(x, x + 1))) if layerwise else None
            )
            computed, computed_wall = time.monotonic(), now()
            if not layerwise:  # every layer in one WRITE per request
                push(range(self.engine.model_config.num_layers))
            pushes.wait()
            pushed, pushed_wall = time.monotonic(), now()
            shared = [
                Span("prefill.compute", started_wall, computed_wall, self.worker_id),
                Span("transfer.tail", computed_wall, pushed_wall, self.worker_id),
                *pushes.spans(),
            ]
            self.metrics.prefill.observe(computed - started)
            self.metrics.transfer_seconds.labels("sent").observe(pushed - computed)
            self.metrics.transfer_bytes.labels("sent").inc(nbytes[0])
            for job, token in zip(runnable, tokens):
                job.done.set_result(
                    PrefillResult(
                        first_token=token,
                        queue_s=started - job.enqueued,
                        prefill_s=computed - started,
                        transfer_s=pushed - computed,
                        transfer_bytes=nbytes[0] // len(runnable),
                        spans=(
                            Span("prefill.queue", job.enqueued_wall, started_wall, self.worker_id),
                            *shared,
                        ),
                    )
                )
        except (TransferFailed, ValueError, RuntimeError) as e:
            for job in runnable:
                if not job.done.done():
                    job.done.set_exception(e)
        finally:
            for xfer in pushes.all():
                xfer.release()
            for job in runnable:
                req = job.request
                req.num_computed_tokens = len(req.token_ids)
                alloc.commit(req.block_ids, req.token_ids, req.num_computed_tokens)
                alloc.free(req.block_ids)  # COMPUTED -> FREE (cached blocks stay reusable)
                req.block_ids = []

    def _chunk(self, req: Request) -> ScheduledChunk:
        start = req.num_computed_tokens  # prefix-cache hits are not recomputed
        return ScheduledChunk(
            token_ids=req.token_ids[start:],
            start=start,
            block_ids=req.block_ids,
            sample=True,
            params=req.params,
            generator=req.generator,
        )

    def _peer(self, dest: Destination) -> tuple[str, Tiles]:
        if dest.worker_id not in self.peers:
            if dest.geometry.block_bytes != self.geometry.block_bytes:
                raise ValueError("decode pool blocks differ in size from ours")
            peer = self.agent.add_peer(dest.agent_metadata)
            tiles = self.agent.prepare_tiles(peer, dest.region, dest.geometry.block_bytes)
            self.peers[dest.worker_id] = (peer, tiles)
        return self.peers[dest.worker_id]
