"""In-process loopback backend: peers live in the same process and bytes move with memmove.
For unit tests of code above the transfer layer only; DRAM regions only.

Agents that should reach each other share one `LoopbackFabric`, which carries their
notifications (nothing is global: two tests never see each other's agents):

    fabric = LoopbackFabric()
    a, b = make_agent("loopback", "a", fabric=fabric), make_agent("loopback", "b", fabric=fabric)
"""

from __future__ import annotations

import ctypes
import itertools
import threading

import torch

from transfer import metadata as md
from transfer.agent import Desc, Done, Transfer, check_descs
from transfer.region_agent import RegionTableAgent


class LoopbackFabric:
    """The 'network' between loopback agents: one notification inbox per agent name."""

    def __init__(self) -> None:
        self._inboxes: dict[str, dict[str, list[bytes]]] = {}
        self._lock = threading.Lock()

    def deliver(self, target: str, sender: str, notif: bytes) -> None:
        with self._lock:
            self._inboxes.setdefault(target, {}).setdefault(sender, []).append(notif)

    def collect(self, name: str) -> dict[str, list[bytes]]:
        """Everything delivered to `name` since the last call, by sender."""
        with self._lock:
            return self._inboxes.pop(name, {})


class LoopbackAgent(RegionTableAgent):
    backend = "loopback"

    def __init__(self, name: str, fabric: LoopbackFabric) -> None:
        super().__init__(name)
        self.fabric = fabric
        self._ids = itertools.count()

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
        if notif:
            self.fabric.deliver(peer, self.name, notif)
        return Done()

    def write(self, peer: str, local: list[Desc], remote: list[Desc], notif: bytes) -> Transfer:
        return self._move(peer, local, remote, notif, write=True)

    def read(self, peer: str, local: list[Desc], remote: list[Desc], notif: bytes) -> Transfer:
        return self._move(peer, local, remote, notif, write=False)

    def notify(self, peer: str, notif: bytes) -> Transfer:
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}; add_peer() its metadata first")
        self.fabric.deliver(peer, self.name, notif)
        return Done()

    def notifications(self) -> dict[str, list[bytes]]:
        return self.fabric.collect(self.name)

    def close(self) -> None:
        self._regions.clear()
        self._peers.clear()
