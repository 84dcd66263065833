"""Request-length samples from the public traces bundled in pdserve/data/traces."""

from __future__ import annotations

import csv
from functools import cache
from pathlib import Path

TRACE_DIR = Path(__file__).resolve().parent.parent / "data" / "traces"
TRACES = {"azure-conv": "azure2023_conv.csv", "azure-code": "azure2023_code.csv"}


@cache
def azure_lengths(name: str) -> tuple[tuple[int, int], ...]:
    """(prompt tokens, generated tokens) of every request in an Azure 2023 trace."""
    if name not in TRACES:
        raise ValueError(f"trace: unknown {name!r}; choose one of {', '.join(TRACES)}")
    with open(TRACE_DIR / TRACES[name], newline="") as f:
        return tuple(
            (int(row["ContextTokens"]), int(row["GeneratedTokens"])) for row in csv.DictReader(f)
        )
