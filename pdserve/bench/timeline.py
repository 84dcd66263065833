"""`pdserve trace FILE`: per-stage summary of request traces and a timeline plot (one row per
request, a coloured bar per stage, layer pushes and decode steps as ticks)."""

from __future__ import annotations

import statistics
from types import MappingProxyType

from pdserve.trace import STAGES, coverage

COLOURS = MappingProxyType(
    {
        "router.queue": "#9e9e9e",
        "decode.reserve": "#8d6e63",
        "rpc.prefill": "#d7ccc8",
        "prefill.queue": "#ffcc80",
        "prefill.compute": "#ef6c00",
        "transfer.tail": "#7b1fa2",
        "rpc.prefill_reply": "#d7ccc8",
        "rpc.start": "#d7ccc8",
        "decode.admission": "#90caf9",
        "decode.run": "#1565c0",
        "router.stream": "#bdbdbd",
    }
)


def stage_table(records: list[dict]) -> str:
    """Mean and p50/p99 milliseconds per top-level stage, and how much of each request the
    spans cover."""
    per: dict[str, list[float]] = {name: [] for name in STAGES}
    cover = []
    for rec in records:
        for span in rec["spans"]:
            if span.name in per:
                per[span.name].append(span.duration * 1e3)
        cover.append(coverage(rec["spans"], rec["arrival"], rec["end"]))
    e2e = [(r["end"] - r["arrival"]) * 1e3 for r in records]
    lines = [
        f"{len(records)} requests; stage times in ms",
        f"{'stage':<18} {'mean':>9} {'p50':>9} {'p99':>9}",
    ]

    def row(name: str, values: list[float]) -> str:
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        mean, p50 = statistics.fmean(values), statistics.median(values)
        return f"{name:<18} {mean:>9.2f} {p50:>9.2f} {p99:>9.2f}"

    for name in STAGES:
        if per[name]:
            lines.append(row(name, per[name]))
    lines.append(row("end to end", e2e))
    lines.append(
        f"spans cover {min(cover):.1%} .. {max(cover):.1%} of each request "
        f"(median {statistics.median(cover):.1%})"
    )
    return "\n".join(lines)


def plot_timeline(records: list[dict], path: str, max_requests: int = 64) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = sorted(records, key=lambda r: r["arrival"])[:max_requests]
    t0 = rows[0]["arrival"]
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.28 * len(rows)))
    for y, rec in enumerate(rows):
        for span in rec["spans"]:
            start, width = span.start - t0, span.duration
            if span.name in COLOURS:
                ax.barh(y, width, left=start, height=0.7, color=COLOURS[span.name], lw=0)
            elif span.name in ("push.layer", "push.all"):
                ax.plot([span.end - t0] * 2, [y - 0.35, y - 0.1], color="#4a148c", lw=0.6)
            elif span.name == "decode.step":
                ax.plot([span.end - t0] * 2, [y + 0.1, y + 0.35], color="white", lw=0.4)
            elif span.name == "decode.preempted":
                ax.barh(y, width, left=start, height=0.3, color="#c62828", lw=0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["request_id"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first request arrived")
    ax.set_title("pdserve: where each request spent its time (ticks: layer pushes, decode steps)")
    legend = [Patch(color=c, label=n) for n, c in COLOURS.items() if not n.startswith("rpc.")]
    legend.append(Patch(color=COLOURS["rpc.prefill"], label="rpc hops"))
    legend.append(Patch(color="#c62828", label="preempted"))
    ax.legend(handles=legend, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
