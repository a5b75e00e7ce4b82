"""PNG plots for the report, drawn from report.json: hit rate per workload, TTFT cached vs
baseline, and hit rate over time for the trace."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HIT_RATE = "hit_rate.png"
TTFT = "ttft.png"
TRACE_HIT_RATE = "trace_hit_rate.png"


def plot_hit_rates(workloads: dict, path: Path) -> None:
    names = list(workloads)
    x = np.arange(len(names))
    prefix = [100 * (workloads[n]["prefix_hit_rate"] or 0) for n in names]
    reuse = [100 * (workloads[n]["reuse_rate"] or 0) for n in names]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names) + 2), 4))
    ax.bar(x - 0.2, prefix, 0.4, label="prefix hit rate")
    ax.bar(x + 0.2, reuse, 0.4, label="reuse rate (prefix + blended)")
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.set_ylabel("% of prompt tokens")
    ax.set_ylim(0, 100)
    ax.set_title("Prompt tokens served from cache")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft(workloads: dict, path: Path) -> None:
    names = list(workloads)
    data, positions, colors = [], [], []
    for i, n in enumerate(names):
        data.append(workloads[n]["samples"]["ttft_ms"] or [np.nan])
        positions.append(3 * i)
        colors.append("tab:blue")
        base = workloads[n].get("baseline")
        if base is not None:
            data.append(base["samples"]["ttft_ms"] or [np.nan])
            positions.append(3 * i + 1)
            colors.append("tab:orange")
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names) + 2), 4))
    boxes = ax.boxplot(data, positions=positions, widths=0.8, patch_artist=True, showfliers=True)
    for patch, color in zip(boxes["boxes"], colors):
        patch.set_facecolor(color)
    ax.set_xticks([3 * i + 0.5 for i in range(len(names))], names, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT: cached (blue) vs baseline (orange)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_trace_hit_rate(entry: dict, path: Path, window: int | None = None) -> None:
    """Token-weighted prefix hit rate over the last `window` finished requests (default: a tenth
    of them, 5 to 200), and cumulative."""
    timeline = np.asarray(entry["samples"]["timeline"], dtype=float).reshape(-1, 4)
    t, prompt, hits = timeline[:, 0], timeline[:, 1], timeline[:, 2]
    cum = 100 * np.cumsum(hits) / np.maximum(np.cumsum(prompt), 1)
    if window is None:
        window = min(200, max(5, len(t) // 10))
    w = max(1, min(window, len(t)))
    kernel = np.ones(w)
    rolling = 100 * np.convolve(hits, kernel)[: len(t)] / np.maximum(np.convolve(prompt, kernel)[: len(t)], 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(t, rolling, label=f"last {w} requests")
    ax.plot(t, cum, label="cumulative")
    ax.set_xlabel("seconds since the phase started")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.set_title("Trace replay: prefix hit rate over time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_plots(report: dict, out_dir: Path) -> list[str]:
    """Writes the plots into out_dir; returns their file names."""
    workloads = report["workloads"]
    if not workloads:
        return []
    out_dir = Path(out_dir)
    files = [HIT_RATE, TTFT]
    plot_hit_rates(workloads, out_dir / HIT_RATE)
    plot_ttft(workloads, out_dir / TTFT)
    trace = workloads.get("trace")
    if trace is not None and trace["samples"]["timeline"]:
        plot_trace_hit_rate(trace, out_dir / TRACE_HIT_RATE)
        files.append(TRACE_HIT_RATE)
    return files
