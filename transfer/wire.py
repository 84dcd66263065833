"""The wire contract between a prefill and a decode worker: what a pool looks like to a peer.

Both sides describe their KV pool's contents with `KVLayoutSpec` (model, dtype, block size,
head layout, layer count) and its bytes with `PoolGeometry`; a `PoolLayout` is the two
together as a peer receives them with every reservation: `(KV_WIRE_VERSION, layout_hash)`
for the handshake, and where each block of each layer plane lies in the registered region.
The prefill worker refuses to push into a pool whose layout hash differs from its own, or
whose wire version it does not speak.

A pool `[*planes, num_blocks, *block]` (see pdserve/kv/kv_cache.py) is `planes` runs of
`num_blocks` blocks: GQA has 2 planes per layer (K, V), MLA one. Block b of plane p starts
at `(p * num_blocks + b) * block_bytes`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

# 2: PoolLayout carries planes per layer; 3: fenced notifications; 4: tensor-parallel pools
# (each rank's KV heads in its layout, pushes in parts)
KV_WIRE_VERSION = 4
_FENCE_SEP = b"#"


class Note(NamedTuple):
    request_id: str
    fence: int
    part: int  # which of the push's parts this notification ends
    parts: int  # how many parts the push has (one per pair of prefill and decode ranks)
    unposted: bool = False  # no WRITE of this reservation was or will be posted


_UNPOSTED = b"none"


def notification(request_id: str, fence: int, part: int = 0, parts: int = 1) -> bytes:
    """What a push's last WRITE carries: the KV of this reservation (`fence`, its fencing
    token from Reserve) is in; between tensor-parallel groups, part `part` of `parts` of it
    (one WRITE stream per pair of ranks)."""
    note = request_id.encode() + _FENCE_SEP + str(fence).encode()
    if parts != 1:
        note += _FENCE_SEP + f"{part}/{parts}".encode()
    return note


def unposted_notification(request_id: str, fence: int) -> bytes:
    """What a prefill worker that gave a prompt up before posting any WRITE of it sends
    (a notification alone): the reservation `fence` will receive nothing, so its blocks
    need not wait out the push window. A worker older than this drops it (the window
    ends the fence, as before)."""
    return request_id.encode() + _FENCE_SEP + str(fence).encode() + _FENCE_SEP + _UNPOSTED


def parse_notification(note: bytes) -> Note | None:
    """-> Note, or None for anything else."""
    head, sep, tail = note.rpartition(_FENCE_SEP)
    if not sep:
        return None
    if tail == _UNPOSTED:
        head, sep, fence = head.rpartition(_FENCE_SEP)
        if not sep or not fence.isdigit():
            return None
        return Note(head.decode(errors="replace"), int(fence), 0, 1, unposted=True)
    part, parts = 0, 1
    k, slash, n = tail.partition(b"/")
    if slash:
        if not (k.isdigit() and n.isdigit()) or int(k) >= int(n):
            return None
        part, parts = int(k), int(n)
        head, sep, tail = head.rpartition(_FENCE_SEP)
        if not sep:
            return None
    if not tail.isdigit():
        return None
    return Note(head.decode(errors="replace"), int(tail), part, parts)


class HandshakeRefused(RuntimeError):
    """The peers' KV layouts or wire versions differ; no byte may move between them."""


@dataclass(frozen=True)
class KVLayoutSpec:
    model: str  # architecture identity, e.g. "llama" or the checkpoint name
    dtype: str  # "float32", "bfloat16", ...
    block_size: int
    num_layers: int
    token_shape: tuple[
        int, ...
    ]  # one token's KV in one layer: (2, kv_heads, head_dim) or (r + dr,)

    def layout_hash(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PoolGeometry:
    num_blocks: int
    block_bytes: int  # one block of one plane
    planes_per_layer: int  # 2 (GQA: K, V) or 1 (MLA: the latent)

    def offset(self, plane: int, block: int) -> int:
        return (plane * self.num_blocks + block) * self.block_bytes

    def tile_indices(self, layer: int, blocks: np.ndarray) -> np.ndarray:
        """Indices of (plane of `layer`, block) tiles when the pool is cut into blocks:
        plane-major, so two pools give matching pairs for matching block lists."""
        planes = np.arange(layer * self.planes_per_layer, (layer + 1) * self.planes_per_layer)
        return (planes[:, None] * self.num_blocks + blocks[None, :]).ravel()


@dataclass(frozen=True)
class PoolLayout:
    """A worker's KV pool as a peer sees it: the handshake and the bytes."""

    wire_version: int
    layout_hash: str
    geometry: PoolGeometry
    region: int  # the pool's region id in the owner's agent metadata
    # the KV heads of every block it holds (a tensor-parallel rank's: transfer/heads.py);
    # None: every head (no tensor parallelism)
    heads: object = None


def check_handshake(ours: KVLayoutSpec, wire_version: int, layout_hash: str) -> None:
    if wire_version != KV_WIRE_VERSION:
        raise HandshakeRefused(
            f"KV wire version {wire_version} is not ours ({KV_WIRE_VERSION}); upgrade both sides"
        )
    if layout_hash != ours.layout_hash():
        raise HandshakeRefused(
            f"KV layout hash {layout_hash} != ours {ours.layout_hash()} ({ours}): the workers "
            f"run different models, dtypes, block sizes or head layouts"
        )
