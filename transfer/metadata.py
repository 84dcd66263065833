"""Agent metadata on the wire: a JSON header (name, backend, regions) plus the backend's own
opaque bytes. No pickle: metadata arrives from other processes."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

HEADER = struct.Struct("<I")  # length of the JSON header


@dataclass(frozen=True)
class Region:
    addr: int
    length: int
    mem: str  # "DRAM" or "VRAM"
    dev: int  # CUDA device index (0 for DRAM)


def region_of(tensor: torch.Tensor) -> Region:
    if not tensor.is_contiguous():
        raise ValueError("only contiguous tensors can be registered")
    cuda = tensor.device.type == "cuda"
    return Region(
        addr=tensor.data_ptr(),
        length=tensor.numel() * tensor.element_size(),
        mem="VRAM" if cuda else "DRAM",
        dev=tensor.device.index or 0 if cuda else 0,
    )


def encode(name: str, backend: str, regions: dict[int, Region], blob: bytes = b"") -> bytes:
    header = {
        "name": name,
        "backend": backend,
        "regions": {str(k): [r.addr, r.length, r.mem, r.dev] for k, r in regions.items()},
    }
    raw = json.dumps(header).encode()
    return HEADER.pack(len(raw)) + raw + blob


def _parsed(metadata: bytes) -> tuple[dict, int]:
    """-> (the JSON header, where the backend's bytes start); ValueError when malformed."""
    try:
        (size,) = HEADER.unpack_from(metadata)
        header = json.loads(metadata[HEADER.size : HEADER.size + size])
        if not isinstance(header, dict):
            raise TypeError("not an object")
    except (struct.error, ValueError, TypeError) as e:
        raise ValueError(f"agent metadata is malformed ({e})") from None
    return header, HEADER.size + size


def decode(metadata: bytes, backend: str) -> tuple[str, dict[int, Region], bytes]:
    header, end = _parsed(metadata)
    try:
        regions = {int(k): Region(*v) for k, v in header["regions"].items()}
        name = header["name"]
        peer_backend = header["backend"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"agent metadata is malformed ({e})") from None
    if peer_backend != backend:
        raise ValueError(f"peer speaks transfer backend {peer_backend!r}, we speak {backend!r}")
    return name, regions, metadata[end:]


def agent_name(metadata: bytes) -> str:
    """The agent a peer's metadata names (ValueError when malformed)."""
    name = _parsed(metadata)[0].get("name")
    if not isinstance(name, str):
        raise ValueError("agent metadata is malformed (no agent name)")
    return name


def resolve(regions: dict[int, Region], desc, side: str) -> tuple[int, int, int, str]:
    """Desc -> (address, length, device, memory type), bounds-checked."""
    region = regions.get(desc.region)
    if region is None:
        raise ValueError(f"{side} descriptor names unknown region {desc.region}")
    if desc.offset < 0 or desc.length < 0 or desc.offset + desc.length > region.length:
        raise ValueError(f"{side} descriptor {desc} overruns region of {region.length} bytes")
    return region.addr + desc.offset, desc.length, region.dev, region.mem
