"""The gRPC client SDK: `from pdserve.client import Client, AsyncClient`.

    client = Client("127.0.0.1:50051")
    result = client.generate("Hello", max_tokens=32, temperature=0)
    result.token_ids, result.text, result.timings["ttft_s"]
    for token in client.stream([1, 2, 3], max_tokens=8): ...   # closing it aborts everywhere

Keyword arguments mirror `SamplingParams` and are validated client-side (ValueError naming
the field). Server errors arrive as `PdserveError` subclasses carrying the gRPC status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc

from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.sampling_params import SamplingParams
from pdserve.serving.convert import sampling_to_proto, spans_from_proto
from pdserve.trace import Span

TIMING_KEYS = (
    "queue_s",
    "prefill_s",
    "transfer_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "arrival_unix",
    "end_unix",
)


class PdserveError(RuntimeError):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class InvalidRequest(PdserveError, ValueError):
    """INVALID_ARGUMENT: the request itself is wrong."""


class Overloaded(PdserveError):
    """RESOURCE_EXHAUSTED: no room now; retry later."""


class Unavailable(PdserveError):
    """UNAVAILABLE: no worker can serve the request."""


def _error(e: grpc.RpcError) -> PdserveError:
    kind = {
        grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
        grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
        grpc.StatusCode.UNAVAILABLE: Unavailable,
    }.get(e.code(), PdserveError)
    return kind(e.code(), e.details() or "")


@dataclass
class GenerateResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    timings: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    trace: list[Span] = field(default_factory=list)  # every process's spans (pdserve.trace)

    def trace_record(self) -> dict:
        """This request's trace as one JSON-serialisable record (see pdserve.trace)."""
        return {
            "request_id": self.request_id,
            "arrival": self.timings.get("arrival_unix", 0.0),
            "end": self.timings.get("end_unix", 0.0),
            "spans": [s.to_dict() for s in self.trace],
        }


def build_request(prompt: str | list[int], sampling: dict) -> pb.GenerateRequest:
    params = SamplingParams(**sampling)
    msg = pb.GenerateRequest(protocol_version=PROTOCOL_VERSION, sampling=sampling_to_proto(params))
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        msg.token_ids.ids.extend(prompt)
    return msg


def timings_of(t: pb.Timings) -> dict:
    """A final message's timings as a plain dict (seconds, wall-clock marks, worker ids)."""
    return {
        **{k: getattr(t, k) for k in TIMING_KEYS},
        "prefill_worker": t.prefill_worker,
        "decode_worker": t.decode_worker,
    }


def _absorb(result: GenerateResult, msg: pb.GenerateResponse) -> None:
    result.request_id = msg.request_id
    result.token_ids.extend(msg.token_ids)
    if msg.finished:
        result.finish_reason = msg.finish_reason
        result.text = msg.text
        result.timings = timings_of(msg.timings)
        result.prompt_tokens = msg.prompt_tokens
        result.trace = spans_from_proto(msg.trace)


class Client:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = rpc.RouterStub(self.channel)

    def health(self) -> pb.HealthResponse:
        try:
            return self.stub.Health(pb.Empty(), timeout=5)
        except grpc.RpcError as e:
            raise _error(e) from None

    def workers(self) -> list[pb.WorkerInfo]:
        return list(self.stub.ListWorkers(pb.Empty(), timeout=5).workers)

    def generate(self, prompt: str | list[int], **sampling) -> GenerateResult:
        result = GenerateResult(request_id="")
        try:
            for msg in self.stub.Generate(build_request(prompt, sampling)):
                _absorb(result, msg)
        except grpc.RpcError as e:
            raise _error(e) from None
        return result

    def stream(self, prompt: str | list[int], **sampling) -> Iterator[int]:
        """Yields token ids as they arrive; closing the generator cancels the request."""
        call = self.stub.Generate(build_request(prompt, sampling))
        try:
            for msg in call:
                yield from msg.token_ids
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise _error(e) from None
        finally:
            call.cancel()

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=5).found

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The same API on grpc.aio, for asyncio programs and load generators."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = rpc.RouterStub(self.channel)

    async def generate(self, prompt: str | list[int], **sampling) -> GenerateResult:
        result = GenerateResult(request_id="")
        try:
            async for msg in self.stub.Generate(build_request(prompt, sampling)):
                _absorb(result, msg)
        except grpc.RpcError as e:
            raise _error(e) from None
        return result

    async def stream(self, prompt: str | list[int], **sampling) -> AsyncIterator[int]:
        call = self.stub.Generate(build_request(prompt, sampling))
        try:
            async for msg in call:
                for token in msg.token_ids:
                    yield token
        finally:
            call.cancel()

    async def close(self) -> None:
        await self.channel.close()
