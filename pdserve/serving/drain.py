"""Calling a router's Drain as a cluster member (it presents the cluster secret): the
`pdserve drain` command, the sweep's late-joining replicas and the tests all go through
here."""

from __future__ import annotations

from collections.abc import Iterator

from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving import auth


def drain(
    router: str,
    security,
    worker_id: str,
    undo: bool = False,
    timeout_s: float = 900.0,
    stop: bool = False,
) -> Iterator[pb.DrainProgress]:
    """Drain `worker_id` (or, `undo`, give it new requests again; `stop`: then stop it) ->
    each progress message, the last with `done` set when nothing is left on it (and
    `stopped` when it was told to stop). grpc.RpcError as the router says."""
    with auth.channel(router, security) as channel:
        yield from rpc.RouterStub(channel).Drain(
            pb.DrainRequest(worker_id=worker_id, undo=undo, stop=stop), timeout=timeout_s
        )


def drained(
    router: str, security, worker_id: str, undo: bool = False, timeout_s: float = 900.0
) -> bool:
    """Drain (or undo) to the end -> whether it finished with nothing left on the worker."""
    messages = list(drain(router, security, worker_id, undo, timeout_s))
    return bool(messages) and messages[-1].done
