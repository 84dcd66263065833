"""proto messages <-> pdserve dataclasses, at the process edge and nowhere else (the KV
pool's layout converts in pdserve/serving/kv_pool.py, which needs the transfer package;
this module stays light enough for the client SDK)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.rpc import pdserve_pb2 as pb
from pdserve.sampling_params import SamplingParams
from pdserve.trace import Span

if TYPE_CHECKING:
    from pdserve.serving.registration import WorkerStats


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        has_seed=params.seed is not None,
        seed=params.seed or 0,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the bad field (the caller answers INVALID_ARGUMENT)."""
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.has_seed else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )


def spans_to_proto(spans) -> list[pb.Span]:
    return [
        pb.Span(name=s.name, start=s.start, end=s.end, worker=s.worker, layer=s.layer)
        for s in spans
    ]


def spans_from_proto(msgs) -> list[Span]:
    return [Span(m.name, m.start, m.end, m.worker, m.layer) for m in msgs]


def worker_info(base: pb.WorkerInfo, stats: WorkerStats) -> pb.WorkerInfo:
    """A worker's identity (`base`) with its current stats, for a heartbeat."""
    info = pb.WorkerInfo()
    info.CopyFrom(base)
    info.free_blocks = stats.free_blocks
    info.total_blocks = stats.total_blocks
    info.running = stats.running
    info.queued_tokens = stats.queued_tokens
    info.headroom_blocks = stats.headroom_blocks
    info.preempted = stats.preempted
    info.parked_request_ids[:] = stats.parked
    if stats.projected_free_blocks is not None:
        info.projected_free_blocks = stats.projected_free_blocks
    return info
