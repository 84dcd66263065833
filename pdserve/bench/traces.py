"""Requests from the public traces bundled in pdserve/data/traces (see its README).

Each trace becomes `TraceRequest`s: arrival second (from the trace's first request), prompt
tokens and generated tokens, as recorded.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from types import MappingProxyType

TRACE_DIR = Path(__file__).resolve().parent.parent / "data" / "traces"
TRACES = MappingProxyType(
    {
        "azure-conv": "azure2023_conv.csv",
        "azure-code": "azure2023_code.csv",
        "mooncake-conv": "mooncake_conversation.jsonl",
    }
)


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def _azure(path: Path) -> list[TraceRequest]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    # timestamps carry 7 fractional digits; datetime takes 6
    times = [datetime.fromisoformat(r["TIMESTAMP"][:26]) for r in rows]
    return [
        TraceRequest(
            (t - times[0]).total_seconds(), int(r["ContextTokens"]), int(r["GeneratedTokens"])
        )
        for t, r in zip(times, rows)
    ]


def _mooncake(path: Path) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            out.append(
                TraceRequest(row["timestamp"] / 1000, row["input_length"], row["output_length"])
            )
    return out


@cache
def trace_requests(name: str) -> tuple[TraceRequest, ...]:
    if name not in TRACES:
        raise ValueError(f"trace: unknown {name!r}; choose one of {', '.join(TRACES)}")
    path = TRACE_DIR / TRACES[name]
    return tuple(_mooncake(path) if path.suffix == ".jsonl" else _azure(path))
