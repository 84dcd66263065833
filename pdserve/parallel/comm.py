"""The collectives of one tensor-parallel group, as a sharded model calls them.

    comm.all_reduce(x)    sum over the ranks, in place (after a row-parallel matmul)
    comm.gather_cols(x)   rank 0 gets the ranks' column blocks side by side; others None

A group is torch.distributed's own process group object (gloo on CPU, NCCL on CUDA) made
over a TCP store: no global default group, so one process can hold several groups over its
life (tests build and close many). `SINGLE` is the group of one: every call is the identity,
and a model built without tensor parallelism runs exactly the code it always ran.

A collective that fails (a peer died: gloo reports the reset connection at once; a frozen
peer: each collective's timeout) raises `RankFailed`: the group is out of service and a retry on
it cannot help.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


class RankFailed(RuntimeError):
    """A rank of the tensor-parallel group died or stopped answering; the group is done."""

    retryable = False


class TPComm:
    def __init__(self, rank: int = 0, size: int = 1, group=None, timeout_s: float = 120.0) -> None:
        self.rank = rank
        self.size = size
        self._group = group
        self._timeout = datetime.timedelta(seconds=timeout_s)  # of each collective

    @property
    def first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        opts = dist.AllreduceOptions()
        opts.timeout = self._timeout
        self._wait(self._group.allreduce([x], opts), "all_reduce")
        return x

    def gather_cols(self, x: torch.Tensor) -> torch.Tensor | None:
        """[N, c] on each rank -> [N, size * c] on rank 0 (rank r's block at r * c), None
        elsewhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        opts.timeout = self._timeout
        out = [[torch.empty_like(x) for _ in range(self.size)]] if self.first else []
        self._wait(self._group.gather(out, [x], opts), "gather")
        return torch.cat(out[0], dim=-1) if self.first else None

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise RankFailed(f"tensor-parallel {what} failed on rank {self.rank}: {e}") from e


SINGLE = TPComm()


def connect(
    host: str,
    port: int,
    rank: int,
    size: int,
    device: torch.device,
    start_timeout_s: float,
    timeout_s: float,
) -> TPComm:
    """Join group `size` over the TCP store at host:port (rank 0 made it: `make_store`):
    `start_timeout_s` to meet the others, `timeout_s` for each collective after."""
    timeout = datetime.timedelta(seconds=start_timeout_s)
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    return TPComm(rank, size, _group(store, rank, size, device, timeout), timeout_s)


def make_store(host: str, size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, on a port the OS picks (`.port`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)


def first_rank(
    store: dist.TCPStore,
    size: int,
    device: torch.device,
    start_timeout_s: float,
    timeout_s: float,
) -> TPComm:
    timeout = datetime.timedelta(seconds=start_timeout_s)
    return TPComm(0, size, _group(store, 0, size, device, timeout), timeout_s)


def _group(store, rank: int, size: int, device: torch.device, timeout: datetime.timedelta):
    prefixed = dist.PrefixStore("tp", store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
