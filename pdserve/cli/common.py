"""What the command-line modules share: defaults, argument parsers, report printing."""

from __future__ import annotations

import argparse
import os

DEMO_MODEL = "smollm2-135m"
WORKLOAD_CHOICES = (
    "azure-conv",
    "azure-code",
    "mooncake-conv",
    "uniform",
    "reasoning",
    "long-prompt",
)


def _positive_list(text: str, parse, numbers: str, what: str) -> list:
    try:
        values = [parse(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated {numbers}, got {text!r}"
        ) from None
    if not values or not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected positive {what}, got {text!r}")
    return values


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    return _positive_list(text, int, "integers", "integers")


def print_report(report: dict, format_table, json_path: str | None) -> int:
    """Every bench prints its table and, when asked, writes its JSON report."""
    from pdserve.bench.report import write_json

    print(format_table(report))
    if json_path:
        write_json(report, json_path)
        print(f"wrote {json_path}")
    return 0


def model_label(model: str) -> str:
    """`pdserve/sim/configs/qwen2.5-32b.json` -> `qwen2.5-32b`; a preset stays itself."""
    base = os.path.basename(model.rstrip("/"))
    if base == "config.json":
        base = os.path.basename(os.path.dirname(os.path.abspath(model)))
    return base.removesuffix(".json")


def _slo(text: str, relative_ok: bool):
    from pdserve.bench.slo import parse_slo

    try:
        slo = parse_slo(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if slo.relative and not relative_ok:
        raise argparse.ArgumentTypeError(
            f"expected ttft=SECONDS,tpot=SECONDS here (no unloaded run to scale by), got {text!r}"
        )
    return slo


def slo_arg(text: str):
    """argparse type: `ttft=2,tpot=0.05` -> SLO, in seconds."""
    return _slo(text, relative_ok=False)


def rate_list(text: str) -> list[float]:
    """argparse type: comma-separated positive arrival rates (requests per second)."""
    return _positive_list(text, float, "numbers", "requests per second")


def sweep_slo_arg(text: str):
    """argparse type: seconds, or multiples of the unloaded p50s (`ttft=5x,tpot=2x`)."""
    return _slo(text, relative_ok=True)


def add_memory_flags(p) -> None:
    """How much a worker's ranks may hold, weights first and KV the rest (EngineArgs)."""
    p.add_argument(
        "--memory-per-rank",
        type=int,
        default=None,
        metavar="BYTES",
        help="what each rank may hold: its weights, then a KV pool of the rest (so a wider "
        "--tp holds more KV)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FRACTION",
        help="CUDA: each rank's GPU up to this fraction of its memory, weights and KV",
    )
