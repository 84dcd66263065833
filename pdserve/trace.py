"""Per-request traces: spans that each process records for the stages it owns, collected by
the router and returned with the request's final message.

A span is (name, start, end, worker, layer) with wall-clock times (`time.time()`), so spans
from the router, prefill and decode processes share one time axis. On one machine they are
exact; across nodes they are as good as the nodes' clock sync (NTP/PTP).

Top-level stages tile a request's life from arrival at the router to its last token:

    router.queue        arrival -> a decode worker is asked to reserve (waits for room)
    decode.reserve      the Reserve call (blocks leased on the decode worker)
    rpc.prefill         router sends the prompt -> the prefill worker has it
    prefill.queue       the prefill worker has the prompt -> its batch's (last) pass starts
                        (in turns at shared CPUs: the wait for its turn, and the parts of a
                        long prompt computed in earlier turns)
    prefill.compute     the batch's forward pass (KV pushed layer by layer meanwhile)
    transfer.tail       last layer computed -> every layer's push complete
    rpc.prefill_reply   push complete -> the router has the first token
    rpc.start           router sends Start -> the decode worker has it
    decode.admission    Start received -> the request's first decode step begins
    decode.run          first step -> last token (preemptions inside it are marked)
    router.stream       last token on the decode worker -> the router sent the final message

The rpc.* and router.stream spans are the router's own clock readings around a call minus
the worker's spans inside it: RPC transit, serialisation and (first call) connection set-up.

Detail spans sit inside those and are not part of the tiling: `push.layer` (one per layer:
the write posted -> seen complete; `push.all` when every layer goes in one write after the
forward pass), `prefill.part` (a part of a long prompt computed in a turn of its own,
prefill/turns.py), `decode.step` (each of the first 256 steps the request took part in on a
worker; later ones fold into a `decode.steps` span per run of steps, decode/streams.py) and
`decode.preempted` (preempted -> running again), `decode.prefill` (a prompt the decode
worker computed itself, conditional disaggregation: its first step -> its first token; such a
request has no rpc.prefill .. rpc.prefill_reply). What is left between top-level spans is
thread hand-offs inside the router; `coverage` measures how much of the request is spanned.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

STAGES = (
    "router.queue",
    "decode.reserve",
    "rpc.prefill",
    "prefill.queue",
    "prefill.compute",
    "transfer.tail",
    "rpc.prefill_reply",
    "rpc.start",
    "decode.admission",
    "decode.run",
    "router.stream",
)


def now() -> float:
    return time.time()


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # seconds since the epoch
    end: float
    worker: str = ""
    layer: int = -1  # push.layer only

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        return asdict(self)


def hops(marks: tuple[float, float, float, float], prefill: list[Span], decode: list[Span]):
    """The router's spans around its calls: `marks` = (Prefill sent, Prefill answered, Start
    sent, final message sent); `prefill` and `decode` are the workers' spans."""
    prefill_sent, prefill_back, start_sent, end = marks
    first = {s.name: s for s in prefill + decode}
    out = []
    if "prefill.queue" in first and "transfer.tail" in first:
        out.append(Span("rpc.prefill", prefill_sent, first["prefill.queue"].start, "router"))
        out.append(Span("rpc.prefill_reply", first["transfer.tail"].end, prefill_back, "router"))
    if "decode.admission" in first:
        out.append(Span("rpc.start", start_sent, first["decode.admission"].start, "router"))
        last = first.get("decode.run", first["decode.admission"])
        out.append(Span("router.stream", last.end, end, "router"))
    return out


def stages(spans: Iterable[Span]) -> list[Span]:
    """The top-level spans, in time order."""
    return sorted((s for s in spans if s.name in STAGES), key=lambda s: s.start)


def coverage(spans: list[Span], start: float, end: float) -> float:
    """Fraction of [start, end] covered by the top-level spans, counting overlaps once."""
    if end <= start:
        return 0.0
    covered, reach = 0.0, start
    for s in stages(spans):
        lo, hi = max(s.start, reach), min(s.end, end)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered / (end - start)


def write_jsonl(path, records: Iterable[dict]) -> None:
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def read_jsonl(path) -> list[dict]:
    """Trace records ({"request_id", "arrival", "end", "spans": [...]}) from a JSON-lines file;
    ValueError naming the line for anything malformed."""
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rec["spans"] = [Span(**s) for s in rec["spans"]]
                float(rec["arrival"]), float(rec["end"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a trace record ({e})") from None
            records.append(rec)
    return records
