"""Pushing a batch's KV into the decode workers' reserved blocks over the transfer agent.

    PushTarget      one request of a batch: whose blocks go where (a Destination,
                    pdserve/serving/destination.py, in the pushing agent's terms)
    BatchPush       the WRITEs of one batch: `layers(range)` posts one WRITE per request for
                    those layers (the last carries the request id as its notification),
                    `wait()` until each is DONE or its target failed, `spans()` for the
                    trace, `release()`; a target whose WRITE fails (its decode worker
                    died) is `failed` alone: the batch's other pushes go on

The WRITEs themselves are transfer/writes.py's. Between tensor-parallel groups of
different sizes a target carries its head route (transfer/heads.py) and its notification
names its part of the push.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from pdserve.trace import Span, now
from transfer import Transfer, TransferAgent, TransferFailed, XferState
from transfer.writes import HeadRoute, PoolSide, block_runs, write_layers

__all__ = ["BatchPush", "PushTarget"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushTarget:
    """One request of a batch: whose blocks go where."""

    peer: str  # the decode worker's agent name
    remote: PoolSide
    src: np.ndarray  # our blocks, after the destination's cached ones
    dst: np.ndarray  # its blocks, the same count
    notif: bytes  # sent with the last layer's WRITE
    # time.monotonic() after which no WRITE is posted for it, and by which every posted one
    # is complete or given up: the decode worker may hand its blocks to someone else once
    # the router's push window (which contains the caller's deadline) is over
    post_by: float = float("inf")
    done_by: float = float("inf")
    heads: HeadRoute | None = None  # None: every head, whole blocks

    @property
    def runs(self) -> np.ndarray:
        return block_runs(self.src, self.dst)


class BatchPush:
    """The WRITEs of one batch, with the wall-clock time each push (one layer, or all
    layers at once) was posted and first seen complete (polled at every later layer boundary
    and while waiting for the tail).

    A target fails alone: a WRITE that cannot be posted or ends FAILED puts the target in
    `failed` (why, by target), its WRITEs are released (NIXL's chance to abort them) and
    nothing more is posted for it, while the others go on. One batch often pushes to several
    decode workers; one of them dying must fail only the requests it held (failing the batch
    made the router fence the survivors' reserved blocks for a whole push window)."""

    def __init__(
        self,
        agent: TransferAgent,
        local: PoolSide,
        targets: list[PushTarget],
        num_layers: int,
        worker: str,
    ) -> None:
        self.agent, self.local, self.targets = agent, local, targets
        self.num_layers, self.worker = num_layers, worker
        self._runs = [t.runs for t in targets]
        # (layer, or -1 for all; when posted; (target, its WRITE) for each posted)
        self._posted: list[tuple[int, float, list[tuple[int, Transfer]]]] = []
        self._done_at: dict[int, float] = {}
        self._pending: set[int] = set()  # targets with a WRITE not complete, at the last poll
        self.nbytes = 0
        self.abandoned: set[int] = set()  # targets past their deadline: nothing more posted
        self.failed: dict[int, str] = {}  # targets whose push failed -> why
        self._tried: set[int] = set()  # targets a WRITE was handed to the agent for

    def layers(self, layers: range) -> None:
        """Post one WRITE per request for `layers` (none for a request past its deadline,
        then or before: it is abandoned; none for a failed one)."""
        last = layers.stop == self.num_layers
        posted = []
        t = time.monotonic()
        try:
            for i, (target, runs) in enumerate(zip(self.targets, self._runs)):
                if i in self.failed:
                    continue
                if i in self.abandoned or target.post_by <= t:
                    self.abandoned.add(i)
                    continue
                self._tried.add(i)  # before the call: whatever it raises, bytes may have left
                try:
                    xfer, nbytes = write_layers(
                        self.agent,
                        target.peer,
                        layers,
                        self.local,
                        target.remote,
                        (target.src, target.dst, runs),
                        target.notif if last else b"",
                        target.heads,
                    )
                except TransferFailed as e:
                    self._fail(i, f"the push of {self._named(layers)} to {target.peer} failed: {e}")
                    continue
                posted.append((i, xfer))
                self.nbytes += nbytes
        finally:  # whatever raised midway, the WRITEs handed over are polled and released
            self._posted.append((layers.start if len(layers) == 1 else -1, now(), posted))
        self.poll()

    def poll(self) -> bool:
        """True when every posted WRITE of a target not failed is complete; a target whose
        WRITE ended FAILED joins `failed`."""
        pending = set()
        for layer, _, transfers in self._posted:
            if layer in self._done_at:
                continue
            complete = True
            for i, xfer in transfers:
                if i in self.failed:
                    continue
                state = xfer.state()
                if state is XferState.FAILED:
                    peer = self.targets[i].peer
                    self._fail(i, f"the push of {_layer_name(layer)} to {peer} failed")
                elif state is not XferState.DONE:
                    complete = False
                    pending.add(i)
            if complete:
                self._done_at[layer] = now()
        self._pending = pending - set(self.failed)
        return len(self._done_at) == len(self._posted)

    def wait(self, timeout_s: float, poll_s: float) -> None:
        """Until every posted WRITE is complete or its target failed, at most `timeout_s`
        and never past the `done_by` of a target still in the push (complete or not: its
        caller stops waiting then). At that limit the targets still in flight fail, the
        rest stand."""
        give_up = time.monotonic() + timeout_s
        while not self.poll():
            standing = [
                t.done_by
                for i, t in enumerate(self.targets)
                if i not in self.abandoned and i not in self.failed
            ]
            limit = min([give_up, *standing])
            if time.monotonic() > limit:
                why = (
                    f"within push_timeout_s ({timeout_s:g} s)"
                    if limit == give_up
                    else "by the caller's deadline"
                )
                for i in sorted(self._pending):
                    self._fail(i, f"the push to {self.targets[i].peer} was not complete {why}")
                self.poll()  # every layer now has its end
                return
            time.sleep(poll_s)

    def posted(self) -> set[int]:
        """The targets any WRITE was handed to the agent for, refused or not (a post the
        transport refused may have started some of its puts first; one that raised
        midway left no record). The others' reserved blocks can take no byte of this
        batch, whatever it becomes."""
        return set(self._tried)

    def _fail(self, i: int, why: str) -> None:
        """Target i failed: nothing more is posted for it and its WRITEs are let go."""
        self.failed[i] = why
        log.warning("%s", why)
        for _, _, transfers in self._posted:
            for j, xfer in transfers:
                if j == i:
                    xfer.release()

    def _named(self, layers: range) -> str:
        if len(layers) == self.num_layers:
            return "every layer"
        if len(layers) == 1:
            return _layer_name(layers.start)
        return f"layers {layers.start}-{layers.stop - 1}"

    def spans(self) -> list[Span]:
        return [
            Span(
                "push.layer" if layer >= 0 else "push.all",
                start,
                self._done_at[layer],
                self.worker,
                layer,
            )
            for layer, start, _ in self._posted
        ]

    def release(self) -> None:
        for _, _, transfers in self._posted:
            for _, xfer in transfers:
                xfer.release()


def _layer_name(layer: int) -> str:
    return "every layer" if layer < 0 else f"layer {layer}"
