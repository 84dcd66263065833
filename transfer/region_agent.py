"""A base for backends that keep region tables in Python (no prepared descriptor lists):
their own regions and each peer's, as decoded from its metadata. Tiles are computed from
those tables, and a tile transfer is a WRITE of the tiles' descriptors."""

from __future__ import annotations

from transfer import metadata as md
from transfer.agent import Tiles, TransferAgent, tiles_as_descs


class RegionTableAgent(TransferAgent):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._regions: dict[int, md.Region] = {}
        self._peers: dict[str, dict[int, md.Region]] = {}

    def prepare_tiles(self, peer: str | None, region: int, tile_bytes: int) -> Tiles:
        regions = self._regions if peer is None else self._peers[peer]
        if region not in regions:
            raise ValueError(f"unknown region {region}")
        return Tiles(region, regions[region].length // tile_bytes, tile_bytes)

    def write_tiles(self, peer, local: Tiles, local_idx, remote: Tiles, remote_idx, notif):
        src, dst = tiles_as_descs(local, local_idx, remote, remote_idx)
        return self.write(peer, src, dst, notif)
