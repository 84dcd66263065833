"""Pushing a batch's KV into the decode workers' reserved blocks over the transfer agent.

    PushTarget      one request of a batch: whose blocks go where (a Destination,
                    pdserve/serving/destination.py, in the pushing agent's terms)
    BatchPush       the WRITEs of one batch: `layers(range)` posts one WRITE per request for
                    those layers (the last carries the request id as its notification),
                    `wait()` until all are DONE, `spans()` for the trace, `release()`

The WRITEs themselves are transfer/writes.py's. Between tensor-parallel groups of
different sizes a target carries its head route (transfer/heads.py) and its notification
names its part of the push.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pdserve.trace import Span, now
from transfer import Transfer, TransferAgent, TransferFailed, XferState
from transfer.writes import HeadRoute, PoolSide, block_runs, write_layers

__all__ = ["BatchPush", "PushTarget"]


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
    and while waiting for the tail)."""

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
        self._posted: list[tuple[int, float, list[Transfer]]] = []  # (layer or -1 for all, ...)
        self._done_at: dict[int, float] = {}
        self.nbytes = 0
        self.abandoned: set[int] = set()  # targets past their deadline: nothing more posted

    def layers(self, layers: range) -> None:
        """Post one WRITE per request for `layers` (none for a request past its deadline,
        then or before: it is abandoned)."""
        last = layers.stop == self.num_layers
        posted = []
        t = time.monotonic()
        for i, (target, runs) in enumerate(zip(self.targets, self._runs)):
            if i in self.abandoned or target.post_by <= t:
                self.abandoned.add(i)
                continue
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
            posted.append(xfer)
            self.nbytes += nbytes
        self._posted.append((layers.start if len(layers) == 1 else -1, now(), posted))
        self.poll()

    def poll(self) -> bool:
        """True when every posted write is complete; raises TransferFailed on a failed one."""
        for layer, _, transfers in self._posted:
            if layer in self._done_at:
                continue
            states = [t.state() for t in transfers]
            if XferState.FAILED in states:
                raise TransferFailed(f"the push of layer {layer} failed")
            if all(s is XferState.DONE for s in states):
                self._done_at[layer] = now()
        return len(self._done_at) == len(self._posted)

    def wait(self, timeout_s: float, poll_s: float) -> None:
        """Until every posted WRITE is complete: at most `timeout_s`, and never past the
        `done_by` of a request that has WRITEs in flight (raises TransferFailed)."""
        posted = [t.done_by for i, t in enumerate(self.targets) if i not in self.abandoned]
        deadline = min([time.monotonic() + timeout_s, *posted])
        while not self.poll():
            if time.monotonic() > deadline:
                raise TransferFailed("KV push not complete by its deadline")
            time.sleep(poll_s)

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
            for xfer in transfers:
                xfer.release()
