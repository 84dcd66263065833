"""NIXL backend (`nixl-cu12`, its UCX plugin): one-sided WRITE/READ of DRAM on CPU and VRAM
on GPU, with notifications delivered to the target agent.

Progress. NIXL's own progress thread polls its UCX worker with no pause (its Python wrapper
sets the delay to 0): an idle agent kept a core 99.7% busy here. It is off. A thread of
ours progresses the worker instead, by collecting notifications into an inbox: every
BUSY_INTERVAL_S (2 ms) for BUSY_WINDOW_S after this agent posted a transfer or received a
notification, else at an idle pace that starts at IDLE_INTERVAL_S (50 ms) and doubles up to
IDLE_MAX_INTERVAL_S (400 ms) while nothing happens. Each progress call costs about 0.15 ms
here, so an idle agent used 0.3% of a core at a steady 50 ms pace (measured: 99.7% with
NIXL's thread, 4.0% with a 2 ms pace, 0.9% with 20 ms, 0.3% with 50 ms); in an idle 1P2D
cluster on 2026-12-06 the thread used 0.40-0.47% of a core at 50 ms, 0.17-0.20% with the
pace doubling to 400 ms. An initiator also progresses whenever it
polls a transfer's state, and a target whenever it reads notifications, so on the paths we
use (shared memory and CMA on one host, RDMA between hosts) nothing waits for that thread;
it is there for what needs the target's progress meanwhile (UCX's RMA emulated over TCP,
which then runs at the idle pace until the first notification: up to 400 ms late to start
after a long idle). Every call into the NIXL
agent holds one lock: the agent is created without its own locking (NIXL_THREAD_SYNC_NONE)
and is used from several threads.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from types import MappingProxyType

import numpy as np
import torch

from transfer import metadata as md
from transfer.agent import (
    Desc,
    Done,
    Tiles,
    Transfer,
    TransferAgent,
    TransferFailed,
    XferState,
    check_descs,
    check_tiles,
)

BUSY_INTERVAL_S = 0.002
IDLE_INTERVAL_S = 0.05
IDLE_MAX_INTERVAL_S = 0.4
BUSY_WINDOW_S = 1.0
_STATES = MappingProxyType(
    {"DONE": XferState.DONE, "PROC": XferState.PENDING, "ERR": XferState.FAILED}
)


@contextlib.contextmanager
def _refused(op: str):
    """NIXL's own errors while posting (a peer that disconnected after its metadata was
    loaded: `postXferReq: remote agent ... was disconnected`) are a failed transfer, which
    the caller types (a prefill worker answers ABORTED: retry with a new reservation), not a
    failure of this process."""
    try:
        yield
    except TransferFailed:
        raise
    except Exception as e:  # noqa: BLE001 - nixl raises its own exception classes
        raise TransferFailed(f"NIXL could not post the {op}: {e}") from e


class NixlTransfer(Transfer):
    def __init__(self, agent, lock: threading.Lock, handle, first_state: str) -> None:
        self._agent = agent
        self._lock = lock
        self._handle = handle
        self._state = _STATES[first_state]
        self._released = False

    def state(self) -> XferState:
        if self._state is XferState.PENDING:
            with self._lock:
                try:
                    self._state = _STATES[self._agent.check_xfer_state(self._handle)]
                except Exception:  # noqa: BLE001 - nixl's own classes: the peer went away
                    self._state = XferState.FAILED
        return self._state

    def release(self) -> None:
        if not self._released:
            with self._lock, contextlib.suppress(Exception):  # a gone peer's, too
                self._agent.release_xfer_handle(self._handle)
            self._released = True


class NixlAgent(TransferAgent):
    backend = "nixl"

    def __init__(self, name: str) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        super().__init__(name)
        self._agent = nixl_agent(
            # no listener: peers' metadata arrives only inside authenticated RPCs (Reserve
            # answers, Prefill requests; pdserve/serving/auth.py), never on a socket of ours
            name,
            nixl_agent_config(
                backends=["UCX"], enable_prog_thread=False, enable_listen_thread=False
            ),
        )
        if "UCX" not in self._agent.backends:
            raise ImportError("NIXL's UCX plugin could not be instantiated")
        self._ids = itertools.count()
        self._regions: dict[int, md.Region] = {}
        self._reg_descs: dict[int, object] = {}
        self._peers: dict[str, dict[int, md.Region]] = {}
        self._lock = threading.Lock()  # every call into self._agent
        self._inbox: dict[str, list[bytes]] = {}  # notifications collected, not yet read
        self._busy_until = 0.0  # time.monotonic(): progress at the busy pace until then
        self._stop = threading.Event()
        self._progress = threading.Thread(
            target=self._progress_loop, name=f"nixl-progress-{name}", daemon=True
        )
        self._progress.start()

    def _progress_loop(self) -> None:
        idle = IDLE_INTERVAL_S  # the idle pace: doubles while nothing happens
        while True:
            if time.monotonic() < self._busy_until:
                pause, idle = BUSY_INTERVAL_S, IDLE_INTERVAL_S
            else:
                pause, idle = idle, min(IDLE_MAX_INTERVAL_S, 2 * idle)
            if self._stop.wait(pause):
                return
            self._collect()

    def _busy(self) -> None:
        self._busy_until = time.monotonic() + BUSY_WINDOW_S

    def _collect(self) -> None:
        """Progress the worker once; keep what notifications it brought."""
        with self._lock:
            new = self._agent.get_new_notifs()
            for peer, notes in new.items():
                self._inbox.setdefault(str(peer), []).extend(notes)
        if new:
            self._busy()

    def register(self, tensor: torch.Tensor) -> int:
        region = md.region_of(tensor)
        rid = next(self._ids)
        with self._lock:
            self._reg_descs[rid] = self._agent.register_memory(
                [(region.addr, region.length, region.dev, "")], region.mem
            )
        self._regions[rid] = region
        return rid

    def deregister(self, region: int) -> None:
        with self._lock:
            self._agent.deregister_memory(self._reg_descs.pop(region))
        del self._regions[region]

    def metadata(self) -> bytes:
        with self._lock:
            blob = self._agent.get_agent_metadata()
        return md.encode(self.name, self.backend, self._regions, blob)

    def add_peer(self, metadata: bytes) -> str:
        name, regions, blob = md.decode(metadata, self.backend)
        with self._lock:
            loaded = self._agent.add_remote_agent(blob)
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != name:
            raise ValueError(f"peer metadata names {name!r} but carries agent {loaded!r}")
        self._peers[name] = regions
        return name

    def remove_peer(self, peer: str) -> None:
        if self._peers.pop(peer, None) is not None:
            with self._lock:
                self._agent.remove_remote_agent(peer)

    def _descs(self, regions: dict[int, md.Region], descs: list[Desc], side: str):
        rows = [md.resolve(regions, d, side) for d in descs]
        mems = {mem for *_, mem in rows}
        if len(mems) != 1:
            raise ValueError(f"{side} descriptors mix memory types {sorted(mems)}")
        table = np.array([(addr, length, dev) for addr, length, dev, _ in rows], dtype=np.uint64)
        with self._lock:
            return self._agent.get_xfer_descs(table, mems.pop())

    def _post(self, op: str, peer: str, local, remote, notif: bytes) -> Transfer:
        check_descs(local, remote)
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}; add_peer() its metadata first")
        if not local:
            raise ValueError("empty descriptor list")
        local_descs = self._descs(self._regions, local, "local")
        remote_descs = self._descs(self._peers[peer], remote, "remote")
        with self._lock, _refused(op):
            handle = self._agent.initialize_xfer(op, local_descs, remote_descs, peer, notif)
        return self._start(handle, op)

    def _start(self, handle, op: str) -> Transfer:
        self._busy()
        with self._lock:
            try:
                with _refused(op):
                    state = self._agent.transfer(handle)
                if state == "ERR":
                    raise TransferFailed(f"NIXL refused to post the {op}")
            except TransferFailed:
                self._agent.release_xfer_handle(handle)
                raise
        return NixlTransfer(self._agent, self._lock, handle, state)

    def write(self, peer: str, local: list[Desc], remote: list[Desc], notif: bytes) -> Transfer:
        return self._post("WRITE", peer, local, remote, notif)

    def read(self, peer: str, local: list[Desc], remote: list[Desc], notif: bytes) -> Transfer:
        return self._post("READ", peer, local, remote, notif)

    def prepare_tiles(self, peer: str | None, region: int, tile_bytes: int) -> Tiles:
        regions = self._regions if peer is None else self._peers[peer]
        if region not in regions:
            raise ValueError(f"unknown region {region}")
        r = regions[region]
        count = r.length // tile_bytes
        table = np.empty((count, 3), dtype=np.uint64)
        table[:, 0] = r.addr + np.arange(count, dtype=np.uint64) * np.uint64(tile_bytes)
        table[:, 1] = tile_bytes
        table[:, 2] = r.dev
        with self._lock:
            handle = self._agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", table, r.mem)
        return Tiles(handle, count, tile_bytes)

    def notify(self, peer: str, notif: bytes) -> Transfer:
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}; add_peer() its metadata first")
        with self._lock, _refused("notification"):
            self._agent.send_notif(peer, notif)
        self._busy()  # progress soon: the notification goes out with it
        return Done()

    def release_tiles(self, tiles: Tiles) -> None:
        with self._lock, contextlib.suppress(Exception):  # a gone peer's, too
            self._agent.release_dlist_handle(tiles.handle)

    def write_tiles(self, peer, local: Tiles, local_idx, remote: Tiles, remote_idx, notif):
        check_tiles(local, local_idx, remote, remote_idx)
        with self._lock, _refused("WRITE"):
            handle = self._agent.make_prepped_xfer(
                "WRITE",
                local.handle,
                local_idx.astype(np.int32),
                remote.handle,
                remote_idx.astype(np.int32),
                notif,
            )
        return self._start(handle, "WRITE")

    def notifications(self) -> dict[str, list[bytes]]:
        self._collect()  # progress now: a caller waiting for a notification gets it at once
        with self._lock:
            inbox, self._inbox = self._inbox, {}
        return inbox

    def close(self) -> None:
        self._stop.set()
        self._progress.join(timeout=1)
        for peer in list(self._peers):
            self.remove_peer(peer)
        for rid in list(self._regions):
            self.deregister(rid)
