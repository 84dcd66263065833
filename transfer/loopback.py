"""In-process loopback backend: peers live in the same process and bytes move with memmove.
For unit tests of code above the transfer layer only; DRAM regions only."""

from __future__ import annotations

import ctypes
import itertools
import weakref

import torch

from transfer import metadata as md
from transfer.agent import (
    Desc,
    Transfer,
    XferState,
    check_descs,
)
from transfer.region_agent import RegionTableAgent


class _Done(Transfer):
    def state(self) -> XferState:
        return XferState.DONE

    def release(self) -> None:
        return None


class LoopbackAgent(RegionTableAgent):
    backend = "loopback"
    _live: weakref.WeakValueDictionary[str, LoopbackAgent] = weakref.WeakValueDictionary()

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._ids = itertools.count()
        self._inbox: dict[str, list[bytes]] = {}
        LoopbackAgent._live[name] = self

    def register(self, tensor: torch.Tensor) -> int:
        region = md.region_of(tensor)
        if region.mem != "DRAM":
            raise ValueError("the loopback backend moves DRAM only")
        rid = next(self._ids)
        self._regions[rid] = region
        return rid

    def deregister(self, region: int) -> None:
        del self._regions[region]

    def metadata(self) -> bytes:
        return md.encode(self.name, self.backend, self._regions)

    def add_peer(self, metadata: bytes) -> str:
        name, regions, _ = md.decode(metadata, self.backend)
        self._peers[name] = regions
        return name

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def _move(self, peer: str, local: list[Desc], remote: list[Desc], notif: bytes, write: bool):
        check_descs(local, remote)
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}; add_peer() its metadata first")
        for a, b in zip(local, remote):
            src = md.resolve(self._regions, a, "local")[0]
            dst = md.resolve(self._peers[peer], b, "remote")[0]
            if not write:
                src, dst = dst, src
            ctypes.memmove(dst, src, a.length)
        target = LoopbackAgent._live.get(peer)
        if notif and target is not None:
            target._inbox.setdefault(self.name, []).append(notif)
        return _Done()

    def write(self, peer: str, local: list[Desc], remote: list[Desc], notif: bytes) -> Transfer:
        return self._move(peer, local, remote, notif, write=True)

    def read(self, peer: str, local: list[Desc], remote: list[Desc], notif: bytes) -> Transfer:
        return self._move(peer, local, remote, notif, write=False)

    def notifications(self) -> dict[str, list[bytes]]:
        inbox, self._inbox = self._inbox, {}
        return inbox

    def close(self) -> None:
        self._regions.clear()
        self._peers.clear()
