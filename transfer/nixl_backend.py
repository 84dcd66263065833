"""NIXL backend (`nixl-cu12`, its UCX plugin): one-sided WRITE/READ of DRAM on CPU and VRAM
on GPU, with notifications delivered to the target agent."""

from __future__ import annotations

import itertools
from types import MappingProxyType

import numpy as np
import torch

from transfer import metadata as md
from transfer.agent import (
    Desc,
    Tiles,
    Transfer,
    TransferAgent,
    TransferFailed,
    XferState,
    check_descs,
    check_tiles,
)

_STATES = MappingProxyType(
    {"DONE": XferState.DONE, "PROC": XferState.PENDING, "ERR": XferState.FAILED}
)


class NixlTransfer(Transfer):
    def __init__(self, agent, handle, first_state: str) -> None:
        self._agent = agent
        self._handle = handle
        self._state = _STATES[first_state]
        self._released = False

    def state(self) -> XferState:
        if self._state is XferState.PENDING:
            self._state = _STATES[self._agent.check_xfer_state(self._handle)]
        return self._state

    def release(self) -> None:
        if not self._released:
            self._agent.release_xfer_handle(self._handle)
            self._released = True


class NixlAgent(TransferAgent):
    backend = "nixl"

    def __init__(self, name: str) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        super().__init__(name)
        self._agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise ImportError("NIXL's UCX plugin could not be instantiated")
        self._ids = itertools.count()
        self._regions: dict[int, md.Region] = {}
        self._reg_descs: dict[int, object] = {}
        self._peers: dict[str, dict[int, md.Region]] = {}

    def register(self, tensor: torch.Tensor) -> int:
        region = md.region_of(tensor)
        rid = next(self._ids)
        self._reg_descs[rid] = self._agent.register_memory(
            [(region.addr, region.length, region.dev, "")], region.mem
        )
        self._regions[rid] = region
        return rid

    def deregister(self, region: int) -> None:
        self._agent.deregister_memory(self._reg_descs.pop(region))
        del self._regions[region]

    def metadata(self) -> bytes:
        return md.encode(self.name, self.backend, self._regions, self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        name, regions, blob = md.decode(metadata, self.backend)
        loaded = self._agent.add_remote_agent(blob)
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != name:
            raise ValueError(f"peer metadata names {name!r} but carries agent {loaded!r}")
        self._peers[name] = regions
        return name

    def remove_peer(self, peer: str) -> None:
        if self._peers.pop(peer, None) is not None:
            self._agent.remove_remote_agent(peer)

    def _descs(self, regions: dict[int, md.Region], descs: list[Desc], side: str):
        rows = [md.resolve(regions, d, side) for d in descs]
        mems = {mem for *_, mem in rows}
        if len(mems) != 1:
            raise ValueError(f"{side} descriptors mix memory types {sorted(mems)}")
        table = np.array([(addr, length, dev) for addr, length, dev, _ in rows], dtype=np.uint64)
        return self._agent.get_xfer_descs(table, mems.pop())

    def _post(self, op: str, peer: str, local, remote, notif: bytes) -> Transfer:
        check_descs(local, remote)
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}; add_peer() its metadata first")
        if not local:
            raise ValueError("empty descriptor list")
        handle = self._agent.initialize_xfer(
            op,
            self._descs(self._regions, local, "local"),
            self._descs(self._peers[peer], remote, "remote"),
            peer,
            notif,
        )
        state = self._agent.transfer(handle)
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransferFailed(f"NIXL refused to post the {op}")
        return NixlTransfer(self._agent, handle, state)

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
        handle = self._agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", table, r.mem)
        return Tiles(handle, count, tile_bytes)

    def write_tiles(self, peer, local: Tiles, local_idx, remote: Tiles, remote_idx, notif):
        check_tiles(local, local_idx, remote, remote_idx)
        handle = self._agent.make_prepped_xfer(
            "WRITE",
            local.handle,
            local_idx.astype(np.int32),
            remote.handle,
            remote_idx.astype(np.int32),
            notif,
        )
        state = self._agent.transfer(handle)
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransferFailed("NIXL refused to post the WRITE")
        return NixlTransfer(self._agent, handle, state)

    def notifications(self) -> dict[str, list[bytes]]:
        return {str(k): list(v) for k, v in self._agent.get_new_notifs().items()}

    def close(self) -> None:
        for peer in list(self._peers):
            self.remove_peer(peer)
        for rid in list(self._regions):
            self.deregister(rid)
