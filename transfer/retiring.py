"""Buffers a WRITE may still read after its sender gave up on it.

A move that failed after posting (late, or a peer that stopped answering) cannot tell
whether its WRITEs are still reading the buffer they were posted from: deregistering it,
or freeing it, while one is would have the transport read memory that is gone. Such a
buffer (a parked request's KV staged for a move, decode/migrate.py and decode/rank.py) is
kept here, registered, with the transfers that read it, still held: `sweep()` polls them
and lets the buffer go once every one of them has ended (done or failed). A transfer that
never ends (a peer frozen for good) keeps its buffer until the agent closes.

Calls on the agent: the caller holds whatever lock guards it (a decode worker's agent
lock on rank 0; a rank's ops run one at a time).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from transfer.agent import Transfer, TransferAgent, XferState


@dataclass
class _Kept:
    tensor: torch.Tensor
    region: int
    transfers: list[Transfer]


class Retiring:
    """The buffers one agent keeps for transfers that may still read them."""

    def __init__(self, agent: TransferAgent) -> None:
        self.agent = agent
        self._kept: list[_Kept] = []

    def keep(self, tensor: torch.Tensor, region: int, transfers: list[Transfer]) -> None:
        """`tensor` (registered as `region`) stays until every one of `transfers` (not
        released: released here) has ended; at once when there is none."""
        self._kept.append(_Kept(tensor, region, list(transfers)))
        self.sweep()

    def sweep(self) -> int:
        """Let go of every buffer whose transfers have all ended -> bytes still kept."""
        still = []
        for kept in self._kept:
            if any(_pending(x) for x in kept.transfers):
                still.append(kept)
                continue
            for xfer in kept.transfers:
                with contextlib.suppress(Exception):  # each released once, whatever
                    xfer.release()
            with contextlib.suppress(Exception):  # a region gone with its agent
                self.agent.deregister(kept.region)
        self._kept = still
        return self.nbytes

    @property
    def nbytes(self) -> int:
        return sum(k.tensor.numel() * k.tensor.element_size() for k in self._kept)

    def __len__(self) -> int:
        return len(self._kept)


def _pending(xfer: Transfer) -> bool:
    try:
        return xfer.state() is XferState.PENDING
    except Exception:  # noqa: BLE001 - lost track of: failed, so nothing of it runs
        return False
