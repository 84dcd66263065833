"""PNG plots of a simulated sweep: the sweep's own (throughput, TTFT, TPOT, end to end, the
frontier: pdserve/bench/sweep_plots.py) and what only the simulator sees over a run's time:
each engine's KV usage and its memory-bandwidth utilisation, for the highest concurrency of
each policy."""

from __future__ import annotations

import os

from pdserve.bench.sweep_plots import plot_sweep


def plot_sim(report: dict, directory: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = plot_sweep(report, directory)
    last: dict[str, dict] = {}
    for p in report["points"]:
        if p["concurrency"] is None or p["concurrency"] >= last.get(p["policy"], {}).get(
            "concurrency", 0
        ):
            last[p["policy"]] = p
    for key, ylabel, name in (
        (1, "KV blocks in use (fraction of the pool)", "kv_usage.png"),
        (2, "memory bandwidth used (fraction of the measured copy rate)", "bandwidth.png"),
    ):
        if key == 2 and report["profile"]["kind"] != "roofline":
            continue
        fig, axes = plt.subplots(len(last), 1, figsize=(8, 2.4 * len(last)), squeeze=False)
        for ax, (policy, point) in zip(axes[:, 0], last.items()):
            for worker, series in point["series"].items():
                if series:
                    ax.plot([s[0] for s in series], [s[key] for s in series], lw=0.8, label=worker)
            ax.set_title(f"{policy}, concurrency {point['concurrency']} (SIMULATED)", fontsize=9)
            ax.set_ylim(0, 1.05)
            ax.set_xlabel("simulated time (s)")
            ax.set_ylabel(ylabel, fontsize=7)
            ax.grid(alpha=0.3)
            if len(point["series"]) <= 8:
                ax.legend(fontsize=6, ncol=4)
        fig.suptitle(report["title"], fontsize=8)
        fig.tight_layout()
        path = os.path.join(directory, name)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
