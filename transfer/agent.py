"""The NIXL-shaped transfer agent API and the backend registry.

Vocabulary (as NIXL's): register memory regions -> exchange agent metadata -> build
descriptor lists of (region, offset, length) -> WRITE or READ with a notification message ->
poll the transfer's state without blocking -> the target reads its notifications ->
release handles, deregister, close. Regions are registered tensors (DRAM on CPU, VRAM on
CUDA); remote descriptors name the peer's region ids, which its metadata maps to addresses.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from pdserve.registry import Registry

if TYPE_CHECKING:  # tensors come from the pools; a router imports this module without torch
    import torch


class XferState(Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferFailed(RuntimeError):
    """A transfer ended in error or did not finish in time."""


@dataclass(frozen=True)
class Tiles:
    """A region prepared as `count` equal tiles of `tile_bytes` (see prepare_tiles)."""

    handle: object  # backend's prepared list
    count: int
    tile_bytes: int

    def check(self, idx: np.ndarray, side: str) -> None:
        if idx.size and (idx.min() < 0 or idx.max() >= self.count):
            raise ValueError(f"{side} tile index outside [0, {self.count})")


def check_tiles(local: Tiles, local_idx: np.ndarray, remote: Tiles, remote_idx: np.ndarray):
    if local.tile_bytes != remote.tile_bytes or local_idx.shape != remote_idx.shape:
        raise ValueError("tile sizes or index counts differ")
    local.check(local_idx, "local")
    remote.check(remote_idx, "remote")


def tiles_as_descs(local: Tiles, local_idx, remote: Tiles, remote_idx):
    """(local, remote) descriptor lists for tile transfers of backends without prepared
    lists, whose Tiles.handle is the region id."""
    check_tiles(local, local_idx, remote, remote_idx)
    size = local.tile_bytes
    return (
        [Desc(local.handle, int(i) * size, size) for i in local_idx],
        [Desc(remote.handle, int(i) * size, size) for i in remote_idx],
    )


@dataclass(frozen=True)
class Desc:
    region: int  # region id (local, or the peer's for remote descriptors)
    offset: int  # bytes from the region's start
    length: int  # bytes


class Transfer(ABC):
    @abstractmethod
    def state(self) -> XferState:
        """Poll; never blocks."""

    @abstractmethod
    def release(self) -> None:
        """Free the handle (after DONE or FAILED)."""

    def wait(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (state := self.state()) is XferState.PENDING:
            if time.monotonic() > deadline:
                raise TransferFailed(f"transfer not done after {timeout_s}s")
            time.sleep(0.0001)  # leave the CPU to the forward pass and UCX's progress thread
        if state is XferState.FAILED:
            raise TransferFailed("transfer failed")


class Done(Transfer):
    """A transfer complete when made (a notification handed to the transport whole)."""

    def state(self) -> XferState:
        return XferState.DONE

    def release(self) -> None:
        return None


class TransferAgent(ABC):
    backend: str

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    def register(self, tensor: torch.Tensor) -> int:
        """Register a contiguous tensor's memory; returns its region id."""

    @abstractmethod
    def deregister(self, region: int) -> None: ...

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to reach this agent's registered regions."""

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's name."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None: ...

    @abstractmethod
    def write(self, peer: str, local: list[Desc], remote: list[Desc], notif: bytes) -> Transfer:
        """One-sided WRITE of local ranges into the peer's; `notif` reaches the peer after."""

    @abstractmethod
    def read(self, peer: str, local: list[Desc], remote: list[Desc], notif: bytes) -> Transfer:
        """One-sided READ of the peer's ranges into local ones."""

    @abstractmethod
    def prepare_tiles(self, peer: str | None, region: int, tile_bytes: int) -> Tiles:
        """Prepare a region (local when `peer` is None, else the peer's) as equal tiles once,
        so that later transfers name tiles by index (NIXL's prepared descriptor lists)."""

    def release_tiles(self, tiles: Tiles) -> None:
        """Let go of prepared tiles (a dropped peer's); nothing to do where none are kept."""
        return None

    @abstractmethod
    def write_tiles(
        self,
        peer: str,
        local: Tiles,
        local_idx: np.ndarray,
        remote: Tiles,
        remote_idx: np.ndarray,
        notif: bytes,
    ) -> Transfer:
        """WRITE local tiles `local_idx[i]` into the peer's tiles `remote_idx[i]`."""

    @abstractmethod
    def notify(self, peer: str, notif: bytes) -> Transfer:
        """A notification alone, no bytes moved: `notif` reaches the peer's notifications()
        as a WRITE's would."""

    @abstractmethod
    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender."""

    @abstractmethod
    def close(self) -> None: ...


def check_descs(local: list[Desc], remote: list[Desc]) -> None:
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local descriptors for {len(remote)} remote ones")
    for a, b in zip(local, remote):
        if a.length != b.length:
            raise ValueError(f"descriptor lengths differ: {a} vs {b}")


def _nixl(name: str) -> TransferAgent:
    from transfer.nixl_backend import NixlAgent

    return NixlAgent(name)


def _ucxx(name: str) -> TransferAgent:
    from transfer.ucxx_backend import UcxxAgent

    return UcxxAgent(name)


def _loopback(name: str, fabric=None) -> TransferAgent:
    from transfer.loopback import LoopbackAgent

    if fabric is None:
        raise ValueError(
            "transfer backend 'loopback': pass fabric=LoopbackFabric() shared by the peers "
            "(in-process only; between processes use nixl or ucxx)"
        )
    return LoopbackAgent(name, fabric)


BACKENDS: Registry[Callable[..., TransferAgent]] = Registry(
    "transfer backend", {"nixl": _nixl, "ucxx": _ucxx, "loopback": _loopback}
)
# the backends that move bytes between processes (what a worker's --transfer may name)
PROCESS_BACKENDS = ("nixl", "ucxx")


def make_agent(backend: str, name: str, **options) -> TransferAgent:
    """Backends: nixl (default; NIXL's UCX backend), ucxx (UCX through ucxx), loopback
    (in-process, unit tests only: `fabric=` names the peers' shared LoopbackFabric)."""
    factory = BACKENDS[backend]
    try:
        return factory(name, **options)
    except ImportError as e:
        raise ValueError(
            f"transfer backend {backend!r} is not available ({e}); valid backends: "
            f"{', '.join(BACKENDS)}"
        ) from None
