"""The wire contract between a prefill and a decode worker: a version and a layout hash.

Both sides describe their KV pool with `KVLayoutSpec`; the decode worker sends its
`(KV_WIRE_VERSION, layout_hash)` with every reservation and the prefill worker refuses to
push into a pool whose layout differs from its own (model, dtype, block size, head layout,
layer count), or whose wire version it does not speak.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

KV_WIRE_VERSION = 1


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
