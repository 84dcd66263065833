"""Building real prefill and decode workers in the test process, and driving a handoff."""

from __future__ import annotations

from decode.config import DecodeConfig
from decode.streams import EndEvent, Stream
from decode.worker import DecodeWorker, Reserved
from pdserve.engine.args import EngineArgs
from pdserve.serving.destination import Destination
from prefill.config import PrefillConfig
from prefill.worker import PrefillWorker
from transfer import make_agent


def prefill_worker(model: str, worker_id: str, backend: str, args: EngineArgs, **config):
    agent = make_agent(backend, worker_id)
    return PrefillWorker.build(model, args, PrefillConfig(worker_id, **config), agent)


def decode_worker(model: str, worker_id: str, backend: str, args: EngineArgs, **config):
    """A decode worker in this process. Admission is greedy unless given: these tests pin
    the block protocol, whose refusals are greedy's (blocks free now); the default policy
    (cost-aware) is tested on its own (tests/test_admission.py) and through the sweep."""
    agent = make_agent(backend, worker_id)
    config.setdefault("admission", "greedy")
    return DecodeWorker.build(model, args, DecodeConfig(worker_id, **config), agent)


def destination(decode: DecodeWorker, reserved: Reserved) -> Destination:
    """Where `reserved`'s push goes (its fencing token included)."""
    endpoint = decode.endpoint
    return Destination(
        decode.worker_id,
        endpoint.agent.metadata(),
        endpoint.layout,
        reserved.block_ids,
        reserved.cached_blocks,
        reserved.fence,
        endpoint.ranks,
    )


def drain(stream: Stream, timeout_s: float = 30.0) -> tuple[list[int], str]:
    """Every token of a decode stream -> (tokens, finish reason)."""
    tokens = []
    while not isinstance(event := stream.events.get(timeout=timeout_s), EndEvent):
        tokens.append(event.token)
    if event.last_token is not None:  # the token that ended it comes with the end
        tokens.append(event.last_token)
    return tokens, event.finish_reason
