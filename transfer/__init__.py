"""Everything that moves KV bytes: the NIXL-shaped agent API and its backends (nixl, ucxx,
loopback), the wire/layout handshake, and the spill tiers (`transfer.tiers`: host, CXL,
disk). Depends on nothing else of pdserve.

    agent = make_agent("nixl", name)         # or "ucxx"; "loopback" in-process (tests)
    region = agent.register(pool_tensor)     # register memory
    meta = agent.metadata()                  # exchange metadata (bytes, over the control plane)
    peer = other.add_peer(meta)
    xfer = other.write(peer, local_descs, remote_descs, notif=b"req-1")   # one-sided WRITE
    while xfer.state() is XferState.PENDING: ...                          # poll, never blocks
    agent.notifications()                    # on the target: {peer: [b"req-1"]}
    xfer.release(); agent.deregister(region); agent.close()
"""

from transfer.agent import (
    BACKENDS,
    PROCESS_BACKENDS,
    Desc,
    Tiles,
    Transfer,
    TransferAgent,
    TransferFailed,
    XferState,
    make_agent,
)
from transfer.heads import HeadSlice, Route, head_routes, route_descs
from transfer.wire import (
    KV_WIRE_VERSION,
    HandshakeRefused,
    KVLayoutSpec,
    PoolGeometry,
    PoolLayout,
    check_handshake,
    notification,
    parse_notification,
    unposted_notification,
)

__all__ = [
    "BACKENDS",
    "KV_WIRE_VERSION",
    "PROCESS_BACKENDS",
    "Desc",
    "HandshakeRefused",
    "HeadSlice",
    "Route",
    "KVLayoutSpec",
    "PoolGeometry",
    "PoolLayout",
    "Transfer",
    "TransferAgent",
    "Tiles",
    "TransferFailed",
    "XferState",
    "check_handshake",
    "head_routes",
    "make_agent",
    "notification",
    "parse_notification",
    "unposted_notification",
    "route_descs",
]
