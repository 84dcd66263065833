"""ucxx backend (`ucxx-cu12`): the agent API over UCX tag messages, DRAM only.

ucxx's Python bindings expose UCX's tag, stream and active-message operations but not its
one-sided RMA (no memory keys, no put/get), so this backend keeps the one-sided *contract*
with an active target: every agent runs a service thread that receives a transfer's header
(operation, byte ranges, notification), posts receives straight into the registered memory
the ranges name (WRITE) or sends from it (READ), and only then queues the notification and
acknowledges. A transfer is DONE on the initiator when its payload has landed at the target
(the acknowledgement arrived), the same completion NIXL gives.

Tags (64 bits): kind (8) | initiator id (24) | transfer sequence (16) | message index (16).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import logging
import os
import secrets
import struct
import threading
import time
import zlib
from collections import deque

import numpy as np
import torch

from transfer import metadata as md
from transfer.agent import (
    Desc,
    Transfer,
    TransferFailed,
    XferState,
    check_descs,
)
from transfer.region_agent import RegionTableAgent

# ucxx's import writes UCX_* defaults for its CUDA users into os.environ (UCX_RNDV_THRESH=8192,
# UCX_RNDV_FRAG_MEM_TYPE=cuda, UCX_MEMTYPE_CACHE=n, UCX_MAX_RNDV_RAILS=1 and, where it finds
# GPUs, more). This backend moves DRAM only, and left there they would reach every UCX
# context made later in this process (a NIXL agent's) and every process started from it:
# with UCX_RNDV_THRESH=8192 `bench transfer --quick` over NIXL took 40 s instead of 4 s here.
# So the import leaves os.environ as it found it (a variable the user set is kept). It runs
# here, at this module's import, which Python's import lock serializes: two threads making
# their first ucxx agents at once cannot see each other's half-restored environment.


def _import_ucxx():
    saved = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    try:
        import ucxx._lib.libucxx as ucx
        from ucxx._lib.arr import Array
    finally:
        for key in [k for k in os.environ if k.startswith("UCX_") and k not in saved]:
            del os.environ[key]
        os.environ.update(saved)
    return ucx, Array


ucx, Array = _import_ucxx()

HDR, DATA, ACK = 1, 2, 3
MAX_MESSAGES = 1 << 16  # message index field
SEQS = 1 << 16  # transfer sequence field: a number is reused only once its transfer ended
HEADER_BYTES = 2 << 20  # receive buffer for one header: JSON + 16 bytes per range
_PREAMBLE = struct.Struct("<4sI")  # magic, JSON length
_MAGIC = b"PDUX"
# The service thread's pause between polls: the busy pace while transfers are in flight or
# just finished, doubling up to the idle pace when nothing happens (an idle agent polled
# every 0.2 ms kept 11.8% of a core busy here; a new transfer now waits for at most one
# idle pause before its header is seen)
_POLL_S = 0.0002
_IDLE_POLL_S = 0.005
log = logging.getLogger(__name__)


def _tag(kind: int, sender: int, seq: int, idx: int = 0) -> int:
    return (kind << 56) | (sender << 32) | ((seq % SEQS) << 16) | idx


def _view(addr: int, length: int) -> np.ndarray:
    """A writable uint8 view of `length` bytes at `addr` (registered DRAM)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(addr))


def _coalesce(pairs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge neighbouring (src, dst, length) ranges that are adjacent on both sides."""
    out: list[list[int]] = []
    for src, dst, length in pairs:
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            out[-1][2] += length
        else:
            out.append([src, dst, length])
    return [tuple(p) for p in out]


class _Pending:
    """Requests whose completion ends a transfer, plus the acknowledgement status word;
    `on_end` runs once, when the requests first poll complete."""

    def __init__(
        self, requests: list, ack: np.ndarray | None, keep: object = None, on_end=None
    ) -> None:
        self.requests = requests
        self.ack = ack
        self.keep = keep  # buffers that must outlive the requests
        self.on_end = on_end
        self._ending = threading.Lock()  # a caller's poll and the agent's sweep may race

    def poll(self) -> XferState:
        for r in self.requests:
            if not r.completed:
                return XferState.PENDING
        if self.on_end is not None:
            with self._ending:
                on_end, self.on_end = self.on_end, None
            if on_end is not None:
                on_end()
        for r in self.requests:
            try:
                r.check_error()
            except Exception:  # noqa: BLE001 - any UCX error fails the transfer
                return XferState.FAILED
        if self.ack is not None and int(self.ack[0]) != 0:
            return XferState.FAILED
        return XferState.DONE


class UcxxTransfer(Transfer):
    """`orphans`: the agent's, where a transfer released while its requests still run
    leaves them (its header, its acknowledgement word: UCX still reads or writes them),
    until they complete (the agent's thread looks)."""

    def __init__(self, pending: _Pending, orphans: deque) -> None:
        self._pending = pending
        self._orphans = orphans
        self._state = XferState.PENDING

    def state(self) -> XferState:
        if self._state is XferState.PENDING:
            self._state = self._pending.poll()
        return self._state

    def release(self) -> None:
        pending, self._pending = self._pending, _Pending([], None)
        if pending.poll() is XferState.PENDING:  # freeing its buffers now: UCX would write
            self._orphans.append(pending)  # into memory that is gone


class UcxxAgent(RegionTableAgent):
    backend = "ucxx"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._ucx, self._Array = ucx, Array
        self._ctx = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        self._worker = ucx.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        # blocking (epoll) progress: the thread sleeps until UCX has events
        self._worker.start_progress_thread(polling_mode=False, epoll_timeout=100)
        self._address = bytes(self._worker.address.tobytes())
        self._id = zlib.crc32(name.encode()) & 0xFFFFFF
        # from a random number: a restarted agent under the same name (so the same id in
        # its tags) does not begin on the numbers its predecessor's stale receives await
        self._seq = itertools.count(secrets.randbelow(SEQS))
        # sequence numbers of this agent's transfers whose requests may still run (released
        # ones included): a number that wrapped round to one of them would have its
        # acknowledgement (and a READ's payload) matched by the older transfer's receive
        self._live_seqs: set[int] = set()
        self._ids = itertools.count()
        self._eps: dict[bytes, object] = {}  # worker address -> endpoint
        self._peer_addr: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._inbox: dict[str, list[bytes]] = {}
        self._closing = threading.Event()
        self._orphans: deque[_Pending] = deque()  # released while running: UcxxTransfer
        self._server = threading.Thread(target=self._serve, name=f"ucxx-{name}", daemon=True)
        self._server.start()

    # -- memory and peers ------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> int:
        region = md.region_of(tensor)
        if region.mem != "DRAM":
            raise ValueError("the ucxx backend moves DRAM only; use the nixl backend for VRAM")
        rid = next(self._ids)
        with self._lock:
            self._regions[rid] = region
        return rid

    def deregister(self, region: int) -> None:
        with self._lock:
            del self._regions[region]

    def metadata(self) -> bytes:
        with self._lock:
            return md.encode(self.name, self.backend, dict(self._regions), self._address)

    def add_peer(self, metadata: bytes) -> str:
        name, regions, address = md.decode(metadata, self.backend)
        self._endpoint(address)
        self._peers[name] = regions
        self._peer_addr[name] = address
        return name

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)
        self._peer_addr.pop(peer, None)

    def _endpoint(self, address: bytes):
        with self._lock:
            ep = self._eps.get(address)
            if ep is None:
                remote = self._ucx.UCXAddress.create_from_buffer(address)
                ep = self._ucx.UCXEndpoint.create_from_worker_address(self._worker, remote, True)
                self._eps[address] = ep
            return ep

    # -- initiator side --------------------------------------------------------------------

    def _plan(self, peer: str, local: list[Desc], remote: list[Desc]):
        check_descs(local, remote)
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}; add_peer() its metadata first")
        if not local:
            raise ValueError("empty descriptor list")
        with self._lock:
            mine = dict(self._regions)
        pairs = [
            (
                md.resolve(mine, a, "local")[0],
                md.resolve(self._peers[peer], b, "remote")[0],
                a.length,
            )
            for a, b in zip(local, remote)
        ]
        pairs = _coalesce(pairs)
        if len(pairs) >= MAX_MESSAGES:
            raise ValueError(f"{len(pairs)} ranges in one transfer; at most {MAX_MESSAGES - 1}")
        return pairs

    def _header(self, op: str, seq: int, notif: bytes, ranges: np.ndarray) -> np.ndarray:
        meta = {"op": op, "from": self.name, "sender": self._id, "seq": seq, "n": len(ranges)}
        meta["notif"] = notif.hex()
        meta["reply"] = self._address.hex()
        raw = json.dumps(meta).encode()
        blob = _PREAMBLE.pack(_MAGIC, len(raw)) + raw + ranges.astype("<i8").tobytes()
        if len(blob) > HEADER_BYTES:
            raise ValueError(f"transfer header of {len(blob)} bytes exceeds {HEADER_BYTES}")
        return np.frombuffer(blob, dtype=np.uint8).copy()

    def _post(self, op: str, peer: str, local: list[Desc], remote: list[Desc], notif: bytes):
        return self._send(op, peer, self._plan(peer, local, remote), notif)

    def _send(self, op: str, peer: str, pairs: list[tuple[int, int, int]], notif: bytes):
        """The header, then the payload of `pairs` (none: a notification alone)."""
        ep = self._endpoint(self._peer_addr[peer])
        seq = self._take_seq()
        remote_ranges = np.array([(dst, n) for _, dst, n in pairs], dtype=np.int64).reshape(-1, 2)
        try:
            header = self._header(op, seq, notif, remote_ranges)
        except BaseException:
            self._end_seq(seq)  # nothing posted under it yet
            raise
        Array, Tag, full = self._Array, self._ucx.UCXXTag, self._ucx.UCXXTagMaskFull
        ack = np.ones(1, dtype=np.int64)
        views = [_view(src, n) for src, _, n in pairs]
        requests: list = []
        pending = _Pending(requests, ack, keep=(header, views), on_end=lambda: self._end_seq(seq))
        try:
            requests.append(self._worker.tag_recv(Array(ack), Tag(_tag(ACK, self._id, seq)), full))
            if op == "R":  # receives first, so that the target's data never waits unexpected
                for i, v in enumerate(views):
                    requests.append(
                        self._worker.tag_recv(Array(v), Tag(_tag(DATA, self._id, seq, i)), full)
                    )
            requests.append(ep.tag_send(Array(header), Tag(_tag(HDR, self._id, seq))))
            if op == "W":
                for i, v in enumerate(views):
                    requests.append(ep.tag_send(Array(v), Tag(_tag(DATA, self._id, seq, i))))
        except BaseException:
            # what was posted runs on into these buffers, under this number: both are kept
            # with the agent until it completes (nothing posted: freed at the next sweep)
            self._orphans.append(pending)
            raise
        return UcxxTransfer(pending, self._orphans)

    def _take_seq(self) -> int:
        with self._lock:
            for _ in range(SEQS):
                seq = next(self._seq) % SEQS
                if seq not in self._live_seqs:
                    self._live_seqs.add(seq)
                    return seq
        raise TransferFailed(
            f"ucxx agent {self.name}: {SEQS} transfers still running; retry once some have ended"
        )

    def _end_seq(self, seq: int) -> None:
        with self._lock:
            self._live_seqs.discard(seq)

    def write(self, peer: str, local: list[Desc], remote: list[Desc], notif: bytes) -> Transfer:
        return self._post("W", peer, local, remote, notif)

    def notify(self, peer: str, notif: bytes) -> Transfer:
        """A WRITE header with no ranges: the target acknowledges it and files `notif`."""
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}; add_peer() its metadata first")
        return self._send("W", peer, [], notif)

    def read(self, peer: str, local: list[Desc], remote: list[Desc], notif: bytes) -> Transfer:
        return self._post("R", peer, local, remote, notif)

    def notifications(self) -> dict[str, list[bytes]]:
        with self._lock:
            inbox, self._inbox = self._inbox, {}
        return inbox

    # -- target side -----------------------------------------------------------------------

    def _inside(self, addr: int, length: int) -> bool:
        return any(
            r.addr <= addr and addr + length <= r.addr + r.length for r in self._regions.values()
        )

    def _accept(self, raw: np.ndarray) -> tuple[dict, _Pending] | None:
        """Act on one header: post the payload's receives (WRITE) or sends (READ)."""
        magic, size = _PREAMBLE.unpack_from(raw)
        if magic != _MAGIC:
            return None
        meta = json.loads(bytes(raw[_PREAMBLE.size : _PREAMBLE.size + size]))
        start = _PREAMBLE.size + size
        ranges = np.frombuffer(raw[start : start + 16 * meta["n"]], dtype="<i8").reshape(-1, 2)
        with self._lock:
            ok = all(self._inside(int(a), int(n)) for a, n in ranges)
        ep = self._endpoint(bytes.fromhex(meta["reply"]))
        Array, Tag, full = self._Array, self._ucx.UCXXTag, self._ucx.UCXXTagMaskFull
        sender, seq = meta["sender"], meta["seq"]
        requests, keep = [], []
        for i, (addr, n) in enumerate(ranges):
            tag = Tag(_tag(DATA, sender, seq, i))
            if meta["op"] == "W":
                # out-of-bounds ranges still drain the payload (into scratch), then fail
                view = _view(int(addr), int(n)) if ok else np.empty(int(n), dtype=np.uint8)
                requests.append(self._worker.tag_recv(Array(view), tag, full))
            else:
                # a READ of out-of-bounds ranges answers each with an empty message, which
                # completes the initiator's receive (the acknowledgement then fails it);
                # sending nothing left those receives, and the transfer, waiting forever
                view = _view(int(addr), int(n)) if ok else np.zeros(0, dtype=np.uint8)
                requests.append(ep.tag_send(Array(view), tag))
            keep.append(view)
        meta["ok"] = ok
        meta["ep"] = ep
        return meta, _Pending(requests, None, keep=keep)

    def _finish(self, meta: dict, pending: _Pending, state: XferState) -> object:
        good = meta["ok"] and state is XferState.DONE
        if good and meta["notif"]:
            with self._lock:
                self._inbox.setdefault(meta["from"], []).append(bytes.fromhex(meta["notif"]))
        status = np.array([0 if good else 1], dtype=np.int64)
        tag = self._ucx.UCXXTag(_tag(ACK, meta["sender"], meta["seq"]))
        return meta["ep"].tag_send(self._Array(status), tag), status

    def _serve(self) -> None:
        Array, Tag = self._Array, self._ucx.UCXXTag
        mask = self._ucx.UCXXTagMask(0xFF << 56)
        buf = np.empty(HEADER_BYTES, dtype=np.uint8)
        header = self._worker.tag_recv(Array(buf), Tag(HDR << 56), mask)
        active: list[tuple[dict, _Pending]] = []
        acks: list = []
        pause = _POLL_S
        while not self._closing.is_set():
            busy = False
            for _ in range(len(self._orphans)):  # released transfers whose requests ran on
                orphan = self._orphans.popleft()
                if orphan.poll() is XferState.PENDING:
                    self._orphans.append(orphan)
            if header.completed:
                busy = True
                try:
                    header.check_error()
                    got = self._accept(buf.copy())
                    if got is not None:
                        active.append(got)
                except Exception:  # noqa: BLE001 - a bad header must not stop the service
                    log.exception("ucxx agent %s: dropped a malformed transfer header", self.name)
                header = self._worker.tag_recv(Array(buf), Tag(HDR << 56), mask)
            still = []
            for meta, pending in active:
                state = pending.poll()
                if state is XferState.PENDING:
                    still.append((meta, pending))
                else:
                    busy = True
                    try:
                        acks.append(self._finish(meta, pending, state))
                    except Exception:  # noqa: BLE001 - one lost peer must not stop the service
                        log.exception("ucxx agent %s: could not acknowledge a transfer", self.name)
            active = still
            acks = [a for a in acks if not a[0].completed]
            if busy or active:
                pause = _POLL_S
                if not busy:
                    time.sleep(pause)
            else:
                time.sleep(pause)
                pause = min(_IDLE_POLL_S, pause * 2)

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._server.join(timeout=5)
        self._peers.clear()
        self._regions.clear()
        with self._lock:
            eps, self._eps = list(self._eps.values()), {}
        for ep in eps:
            with contextlib.suppress(Exception):  # closing must not raise
                ep.close()
        with contextlib.suppress(Exception):
            self._worker.stop_progress_thread()
