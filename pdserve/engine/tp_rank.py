"""A tensor-parallel rank other than 0: its shard of the model, of the KV pool and of the
spill tiers, driven by rank 0 over a pipe (pdserve/engine/tp_group.py).

A role adds its own per-rank work with `extend("module:Class")`: the class is built with the
rank's RankState, its `op_NAME(*args)` methods answer op NAME (a worker's transfer agent and
its notifications), and a step sent with work (`execute(chunks, work)`) runs
`begin(work)` -> the step with the layer callback it returns -> `end()`, whose value is the
step's answer (a prefill rank's push of its own KV heads). The engine imports no role: the
role names its module.

Each message is (op, args) and runs in order: a block copy, a park or a step lands between
the same two steps as on rank 0. Ops that rank 0 `call`s are answered ("ok", value) or
("error", message); an op that is only sent and fails is reported the same way and the rank
exits, so rank 0's next collective or call fails at once instead of waiting.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from dataclasses import asdict

import torch

log = logging.getLogger(__name__)

# ops answered by ("ok", value); the others are only sent (a step without work, a block copy)
ANSWERED = frozenset(
    {
        "load",
        "cache",
        "extend",
        "park",
        "unpark",
        "keep_prefix",
        "load_prefix",
        "stats",
        "check",
        "memory",
        "close",
    }
)


class RankState:
    """Everything rank r holds, built in two calls: "load" (weights), "cache" (the pool)."""

    def __init__(self, spec) -> None:
        from pdserve.parallel.comm import connect

        self.spec = spec
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        from pdserve.engine.tp_group import START_TIMEOUT_S, STORE_HOST

        self.comm = connect(
            STORE_HOST,
            spec.store_port,
            spec.rank,
            spec.size,
            self.device,
            START_TIMEOUT_S,
            spec.args.tp_timeout_s,
        )
        self.net = self.cache = self.runner = self.offload = self.ext = None

    # -- the ops --------------------------------------------------------------------------
    def load(self) -> dict:
        from pdserve.models import build_model
        from pdserve.parallel.shard import local_config
        from pdserve.weights import resolve

        args = self.spec.args
        source = resolve(self.spec.model)
        self.config = source.config
        self.local = local_config(source.config, self.spec.size)
        self.dtype = args.resolve_dtype(self.device)
        self.net = build_model(
            self.config, self.dtype, self.device, source.weights_on(self.device), comm=self.comm
        )
        from pdserve.engine.memory import held_bytes

        held = held_bytes(self.net)
        budget = args.cache_config(self.local, self.dtype, self.device, held).num_blocks
        return {"num_blocks": budget}

    def make_cache(self, num_blocks: int) -> None:
        from pdserve.attention import ATTENTION_BACKENDS
        from pdserve.engine.build import tiers
        from pdserve.engine.model_runner import ModelRunner
        from pdserve.kv import KVCache
        from pdserve.kv.offload import OffloadedKV

        args = self.spec.args
        self.cache = KVCache(self.local, num_blocks, args.block_size, self.dtype, self.device)
        backend = ATTENTION_BACKENDS[args.attention_backend](self.device)
        self.runner = ModelRunner(self.net, self.cache, backend, self.device, args.seed)
        spill = tiers(args, self.cache)
        self.offload = OffloadedKV(self.cache, spill, args.failpoints) if spill else None

    def execute(self, chunks, work=None):
        from pdserve.engine.batch import ScheduledChunk

        on_layer = self.ext.begin(work) if work is not None else None
        self.runner.execute(
            [ScheduledChunk(t, s, b, smp, None, None) for t, s, b, smp in chunks], on_layer
        )
        return self.ext.end() if work is not None else None

    def extend(self, target: str) -> None:
        import importlib

        module, _, name = target.partition(":")
        self.ext = getattr(importlib.import_module(module), name)(self)

    def parked_shard(self, request_id: str) -> torch.Tensor | None:
        """This rank's shard of a parked request's KV, unpacked from its tier into a new
        buffer shaped like its pool (a live migration's staging, decode/rank.py) -> None
        when it has none, or it was lost or failed its checksum (then it is gone here)."""
        n = self.offload.parked_blocks(request_id) if self.offload is not None else 0
        if n <= 0:
            return None
        pool, dim = self.cache.pool, self.cache.block_dim
        shape = (*pool.shape[:dim], n, *pool.shape[dim + 1 :])
        shard = torch.empty(shape, dtype=pool.dtype, device=pool.device)
        return shard if self.offload.copy_parked(request_id, shard) else None

    def memory(self) -> dict:
        from pdserve.engine.memory import rank_memory

        return asdict(rank_memory(self.spec.rank, self.net, self.cache))

    def check(self, parked: list[str]) -> None:
        if self.offload is not None:
            self.offload.check_integrity(parked)
        else:
            assert not parked, "requests parked without a spill tier"

    def dispatch(self, op: str, args: tuple) -> tuple[bool, object]:
        """-> (whether rank 0 waits for an answer, the answer)."""
        if op == "execute":
            work = args[1] if len(args) > 1 else None
            return work is not None, self.execute(*args)
        if self.ext is not None and hasattr(self.ext, f"op_{op}"):
            return True, getattr(self.ext, f"op_{op}")(*args)
        return op in ANSWERED, self._core_op(op, args)

    def _core_op(self, op: str, args: tuple):
        if op == "load":
            return self.load()
        if op == "cache":
            return self.make_cache(*args)
        if op == "extend":
            return self.extend(*args)
        if op == "copy_blocks":
            return self.cache.copy_blocks(*args)
        if op == "memory":
            return self.memory()
        if op == "check":
            return self.check(*args)
        if op == "close":
            if self.ext is not None and hasattr(self.ext, "close"):
                self.ext.close()
            if self.offload is not None:
                self.offload.close()
            return None
        if op == "keep_prefix":
            self.offload.keep_prefix(*args)
            return self.offload.has_prefix(args[1])
        if op in ("park", "unpark", "drop_parked", "load_prefix", "drop_prefix"):
            return getattr(self.offload, op)(*args)
        if op == "stats":
            return self.offload.stats() if self.offload is not None else None
        raise ValueError(f"unknown tensor-parallel op {op!r}")


def rank_main(conn) -> None:
    """The rank's process: its spec first, then its ops until "close" or EOF."""
    spec = conn.recv()
    logging.basicConfig(
        level=logging.WARNING, format=f"tp-rank{spec.rank} %(levelname)s %(message)s"
    )
    if spec.threads > 0:
        torch.set_num_threads(spec.threads)
    try:
        state = RankState(spec)
    except Exception:
        _report(conn, traceback.format_exc(limit=3))
        sys.exit(1)
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):  # rank 0 closed the pipe or died
            return
        try:
            with torch.no_grad():
                answered, value = state.dispatch(op, args)
        except Exception as e:
            log.error("op %s failed: %s", op, e)
            _report(conn, f"{type(e).__name__}: {e}")
            sys.exit(1)
        if answered:
            conn.send(("ok", value))
        if op == "close":
            return


def _report(conn, message: str) -> None:
    with contextlib.suppress(OSError, EOFError):  # rank 0 is gone: nobody to tell
        conn.send(("error", message))


if __name__ == "__main__":
    from multiprocessing.connection import Connection

    from pdserve.lifetime import adopt

    adopt()  # a killed rank 0 takes us along (pdserve/lifetime.py)

    rank_main(Connection(int(sys.argv[1])))
