"""A tensor-parallel prefill worker's ranks 1..n-1: each pushes its own KV heads, from its
own pool over its own transfer agent, straight into the decode ranks' reserved blocks (no
gather on rank 0). Rank 0 plans the routes (prefill/worker.py) and hands each rank its
targets with the step (`execute(chunks, work)`); the rank posts them layer by layer (or all
at once after the pass), waits for them and answers with what it moved.

Installed on each rank with `extend("prefill.rank:PrefillRank")` (pdserve/engine/tp_rank.py).
"""

from __future__ import annotations

import logging

import numpy as np

from pdserve.serving.rank_kv import RankEndpoint
from prefill.push import BatchPush, PushTarget
from transfer.writes import Peers, PoolSide, pool_side

log = logging.getLogger(__name__)


class PrefillRank(RankEndpoint):
    def __init__(self, state) -> None:
        super().__init__(state)
        self.peers: Peers | None = None  # keyed (decode id, its rank); with the agent
        self.local: PoolSide | None = None
        self.push: BatchPush | None = None
        self.work: dict = {}
        self.error: str | None = None

    def begin(self, work: dict):
        """Targets of this step -> the layer callback (None: everything after the pass)."""
        self.work, self.error = work, None
        if self.local is None:  # the agent exists from op_endpoint on
            self.local = pool_side(self.agent, self.layout)
            self.peers = Peers(self.agent)
        targets = [self._target(t) for t in work["targets"]]
        self.push = BatchPush(self.agent, self.local, targets, work["num_layers"], work["worker"])
        if work["layerwise"]:
            return lambda i: self._post(range(i, i + 1))
        return None

    def end(self) -> dict:
        """Post what is left, wait for every WRITE -> bytes, abandoned, failed and posted
        jobs (posted: any WRITE of theirs left this rank), the error."""
        push, work = self.push, self.work
        try:
            if not work["layerwise"]:
                self._post(range(work["num_layers"]))
            if self.error is None:
                push.wait(work["timeout_s"], work["poll_s"])
        except Exception as e:  # noqa: BLE001 - the answer carries it to rank 0
            self.error = f"{type(e).__name__}: {e}"
        finally:
            push.release()
        jobs = [t["job"] for t in work["targets"]]
        abandoned = sorted({jobs[i] for i in push.abandoned})
        failed = [(jobs[i], why) for i, why in push.failed.items()]
        return {
            "nbytes": push.nbytes,
            "abandoned": abandoned,
            "failed": failed,
            "posted": sorted({jobs[i] for i in push.posted()}),
            "error": self.error,
        }

    def _post(self, layers: range) -> None:
        if self.error is not None:
            return
        try:
            self.push.layers(layers)
        except Exception as e:  # noqa: BLE001 - never inside the forward pass
            log.warning("push of layers %s failed: %s", layers, e)
            self.error = f"{type(e).__name__}: {e}"

    def _target(self, t: dict) -> PushTarget:
        peer, remote = self.peers.side(t["peer_key"], t["metadata"], t["pool"])
        return PushTarget(
            peer=peer,
            remote=remote,
            src=np.asarray(t["src"]),
            dst=np.asarray(t["dst"]),
            notif=t["notif"],
            post_by=t["post_by"],
            done_by=t["done_by"],
            heads=t["heads"],
        )
