"""The figure of ``structllm bench serve --server/--launch --plot out.png``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from structllm.bench.serve_table import Comparison, Run

__all__ = ["plot_comparison"]


def plot_comparison(comparison: Comparison, path: str | Path) -> None:
    """Throughput per target and round, TTFT and ITL CDFs, memory; one PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [t.name for t in comparison.targets]
    fig = Figure(figsize=(13, 9), layout="constrained")
    FigureCanvasAgg(fig)
    (ax_tput, ax_ttft), (ax_itl, ax_mem) = fig.subplots(2, 2)
    fig.suptitle(
        f"{len(names)} servers, {comparison.rounds} round(s), one at a time "
        "(bars: median over rounds; dots: each round)"
    )
    median = comparison.median()
    x = np.arange(len(names))
    ax_tput.bar(x, [median[n]["output_throughput"] or 0 for n in names], alpha=0.7)
    for i, n in enumerate(names):
        ys = [r.result.summary.output_throughput for r in comparison.runs_of(n)]
        ax_tput.scatter([i] * len(ys), ys, color="black", s=12, zorder=3)
    ax_tput.set_xticks(x, names)
    ax_tput.set_ylabel("output tok/s")
    ax_tput.set_title("Output token throughput")

    for ax, title, values_of in (
        (ax_ttft, "Time to first token (CDF)", _ttfts),
        (ax_itl, "Inter-token latency (CDF)", _itls),
    ):
        for n in names:
            v = np.sort([y for r in comparison.runs_of(n) for y in values_of(r)])
            v = v[v > 0]
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, label=n)
        ax.set_title(title)
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("fraction of samples")
        if ax.lines:
            ax.set_xscale("log")
            ax.legend(loc="lower right")
        ax.grid(True, which="both", alpha=0.3)

    kinds = [
        ("peak_rss_mib", "peak RSS, its processes"),
        ("engine_core_peak_rss_mib", "engine core peak RSS"),
        ("kv_cache_mib", "KV cache"),
    ]
    w = 0.8 / len(kinds)
    for j, (key, label) in enumerate(kinds):
        known = [median[n][key] for n in names]
        if any(y is not None for y in known):
            heights = [0.0 if y is None else y for y in known]
            ax_mem.bar(x + (j - 1) * w, heights, w, label=label)
    ax_mem.set_xticks(x, names)
    ax_mem.set_ylabel("MiB")
    ax_mem.set_title("Memory (n/a: not measured)")
    if ax_mem.patches:
        ax_mem.legend(loc="upper right")
    fig.savefig(path, dpi=100)


def _ttfts(run: Run) -> list[float]:
    ok = (r for r in run.result.requests if r.success)
    return [1e3 * t for r in ok if (t := r.ttft) is not None]


def _itls(run: Run) -> list[float]:
    return [1e3 * x for r in run.result.requests if r.success for x in r.itl]
