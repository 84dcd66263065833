"""PNG plots of a capacity sweep: throughput, TTFT and TPOT against the load (closed-loop
clients or open-loop arrival rate; a line per policy), and the TTFT-TPOT frontier (each
point labelled with its load)."""

from __future__ import annotations

import os

from pdserve.bench.sweep import load_label, load_of


def _by_policy(points: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in points:
        out.setdefault(p["policy"], []).append(p)
    return {k: sorted(v, key=load_of) for k, v in out.items()}


def plot_sweep(report: dict, directory: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    os.makedirs(directory, exist_ok=True)
    series = _by_policy(report["points"])
    title = report.get("title") or (
        f"{report['model']}, {report['cluster']['prefill']}P{report['cluster']['decode']}D, "
        f"{report['cluster']['num_kv_blocks']} KV blocks per decode worker"
    )
    paths = []
    open_loop = any(p.get("rate") is not None for p in report["points"])
    xlabel, axis = (
        ("arrival rate (requests/s)", "arrival rate")
        if open_loop
        else ("concurrent clients", "concurrency")
    )

    loads = sorted({load_of(p) for p in report["points"]})

    def finish(
        ax, xlabel: str, ylabel: str, heading: str, xbase: int = 2, ylog: bool = False, ticks=()
    ):
        ax.set_xscale("log", base=xbase)
        if ticks:  # the measured loads, as plain numbers (not powers of the log base)
            ax.set_xticks(list(ticks), [f"{t:g}" for t in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        if ylog:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{heading}\n{title}", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

    def save(fig, name: str) -> None:
        path = os.path.join(directory, name)
        fig.tight_layout()
        fig.savefig(path, dpi=130)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, pts in series.items():
        ax.plot(
            [load_of(p) for p in pts],
            [p["throughput_tok_s"] for p in pts],
            "o-",
            label=policy,
        )
    finish(ax, xlabel, "output tokens / s", f"throughput vs {axis}", ticks=loads)
    save(fig, "throughput.png")

    if all("goodput_req_s" in p for p in report["points"]):
        slo = report.get("slo", {}).get("default") or {}
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy, pts in series.items():
            xs, ys = [load_of(p) for p in pts], [p["goodput_req_s"] for p in pts]
            ax.plot(xs, ys, "o-", label=policy)
        heading = f"SLO goodput vs {axis}"
        if slo.get("ttft_s") is not None and slo.get("tpot_s") is not None:
            heading += f" (TTFT <= {slo['ttft_s']:.2f} s, TPOT <= {slo['tpot_s'] * 1e3:.0f} ms)"
        finish(ax, xlabel, "requests / s meeting the SLO", heading, ticks=loads)
        save(fig, "goodput.png")

    for metric, label in (("ttft", "TTFT (s)"), ("tpot", "TPOT (s)"), ("e2e", "end to end (s)")):
        if not all(f"{metric}_p50_s" in p for p in report["points"]):
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy, pts in series.items():
            xs = [load_of(p) for p in pts]
            (line,) = ax.plot(xs, [p[f"{metric}_p50_s"] for p in pts], "o-", label=f"{policy} p50")
            ax.plot(
                xs,
                [p[f"{metric}_p99_s"] for p in pts],
                "s--",
                color=line.get_color(),
                label=f"{policy} p99",
            )
        finish(ax, xlabel, label, f"{metric.upper()} vs {axis}", ylog=True, ticks=loads)
        save(fig, f"{metric}.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, pts in series.items():
        xs, ys = [p["tpot_p50_s"] for p in pts], [p["ttft_p50_s"] for p in pts]
        ax.plot(xs, ys, "o-", label=policy)
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(
                load_label(p), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    heading = f"TTFT-TPOT frontier (labels: {axis})"
    finish(ax, "TPOT p50 (s)", "TTFT p50 (s)", heading, xbase=10, ylog=True)
    save(fig, "frontier.png")
    return paths
