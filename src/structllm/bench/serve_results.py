"""What ``structllm bench serve`` measured: per-request results, the summary
``vllm bench serve`` prints, and the plot. Pure: no I/O but the PNG.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

if TYPE_CHECKING:
    from structllm.bench.serve import ServeConfig

__all__ = [
    "METRICS",
    "SPEC_DECODE_KEYS",
    "BenchmarkResult",
    "LatencyStats",
    "RequestResult",
    "SpecDecodeCounts",
    "Summary",
    "plot",
    "summarize",
]


@attrs.frozen
class RequestResult:
    """What one request did. Times are seconds from the benchmark's start."""

    index: int
    prompt_tokens: int  # the server's usage figure, else the planned length
    max_tokens: int
    send_time: float
    end_time: float
    # arrival of each chunk with text; [0] is the first token
    chunk_times: tuple[float, ...]
    output_tokens: int
    error: str | None = None
    status: int | None = None  # HTTP status, when a response came

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "success": self.success,
            "status": self.status,
            "error": self.error,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "output_tokens": self.output_tokens,
            "send_time": self.send_time,
            "end_time": self.end_time,
            "ttft": self.ttft,
            "e2e": self.e2e,
            "chunk_times": list(self.chunk_times),
            "itl": self.itl,
        }


@attrs.frozen
class LatencyStats:
    mean_ms: float
    median_ms: float
    p99_ms: float

    @classmethod
    def of(cls, seconds: Iterable[float]) -> LatencyStats | None:
        a = 1e3 * np.asarray(list(seconds), dtype=np.float64)
        if a.size == 0:
            return None
        return cls(float(a.mean()), float(np.median(a)), float(np.percentile(a, 99)))


@attrs.frozen
class SpecDecodeCounts:
    """A server's speculative decoding counters, as its ``/metrics`` gives
    them, or their growth over a run (``after - before``).

    ``drafts``: verification steps of a request with proposals;
    ``draft_tokens``: tokens proposed; ``accepted_tokens``: of those, the
    ones the target accepted (vLLM's ``spec_decode_num_*_total``).
    """

    drafts: float
    draft_tokens: float
    accepted_tokens: float

    def __sub__(self, before: SpecDecodeCounts) -> SpecDecodeCounts:
        return SpecDecodeCounts(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted_tokens - before.accepted_tokens,
        )

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed tokens; None when nothing was proposed."""
        if self.draft_tokens <= 0:
            return None
        return self.accepted_tokens / self.draft_tokens

    @property
    def acceptance_length(self) -> float | None:
        """Tokens a verification step emits on average: its accepted
        proposals and the target's own token after them."""
        if self.drafts <= 0:
            return None
        return 1.0 + self.accepted_tokens / self.drafts

    def to_json(self) -> dict[str, float | None]:
        return {
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_acceptance_length": self.acceptance_length,
            "spec_decode_drafts": self.drafts,
            "spec_decode_draft_tokens": self.draft_tokens,
            "spec_decode_accepted_tokens": self.accepted_tokens,
        }


#: the keys :meth:`SpecDecodeCounts.to_json` writes (None in a summary whose
#: server has no such counters)
SPEC_DECODE_KEYS = tuple(SpecDecodeCounts(0, 0, 0).to_json())


METRICS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@attrs.frozen
class Summary:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    itl: LatencyStats | None
    e2el: LatencyStats | None
    #: the server's speculative decoding counters over the run (None: its
    #: /metrics has none, e.g. llama.cpp, or no /metrics at all)
    spec_decode: SpecDecodeCounts | None = None

    @property
    def speculates(self) -> bool:
        """The server proposed tokens during the run."""
        return self.spec_decode is not None and self.spec_decode.draft_tokens > 0

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        d = self.duration_s
        return self.total_output_tokens / d if d > 0 else 0.0

    @property
    def total_token_throughput(self) -> float:
        d = self.duration_s
        total = self.total_input_tokens + self.total_output_tokens
        return total / d if d > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "duration_s": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for name in METRICS:
            stats: LatencyStats | None = getattr(self, name)
            for stat in ("mean", "median", "p99"):
                value = None if stats is None else getattr(stats, f"{stat}_ms")
                d[f"{stat}_{name}_ms"] = value
        if self.spec_decode is None:
            d.update(dict.fromkeys(SPEC_DECODE_KEYS))
        else:
            d.update(self.spec_decode.to_json())
        return d

    def format(self, config: ServeConfig | None = None) -> str:
        """The table ``vllm bench serve`` prints, in the same words."""
        lines = [f"{' Serving Benchmark Result ':=^50}"]

        def row(label: str, value: object) -> None:
            lines.append(f"{label:<40} {value:<10}".rstrip())

        row("Successful requests:", self.completed)
        row("Failed requests:", self.failed)
        if config is not None:
            rate = config.request_rate
            row("Request rate configured (RPS):", f"{rate:.2f}")
            if config.max_concurrency is not None:
                row("Maximum request concurrency:", config.max_concurrency)
        row("Benchmark duration (s):", f"{self.duration_s:.2f}")
        row("Total input tokens:", self.total_input_tokens)
        row("Total generated tokens:", self.total_output_tokens)
        row("Request throughput (req/s):", f"{self.request_throughput:.2f}")
        row("Output token throughput (tok/s):", f"{self.output_throughput:.2f}")
        row("Total token throughput (tok/s):", f"{self.total_token_throughput:.2f}")
        for name, title in METRICS.items():
            lines.append(f"{title:-^50}")
            stats: LatencyStats | None = getattr(self, name)
            for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
                value = getattr(stats, f"{stat}_ms") if stats is not None else None
                shown = "n/a" if value is None else f"{value:.2f}"
                row(f"{label} {name.upper()} (ms):", shown)
        if self.speculates:  # vLLM's section, only where the server speculated
            spec = self.spec_decode
            assert spec is not None
            accepted, length = spec.acceptance_rate, spec.acceptance_length
            lines.append(f"{'Speculative Decoding':-^50}")
            shown = "n/a" if accepted is None else f"{100 * accepted:.2f}"
            row("Acceptance rate (%):", shown)
            row("Acceptance length:", "n/a" if length is None else f"{length:.2f}")
            row("Drafts:", f"{spec.drafts:.0f}")
            row("Draft tokens:", f"{spec.draft_tokens:.0f}")
            row("Accepted tokens:", f"{spec.accepted_tokens:.0f}")
        lines.append("=" * 50)
        return "\n".join(lines)


def summarize(results: Sequence[RequestResult]) -> Summary:
    """Aggregate figures; the duration runs from 0 to the last request's end."""
    ok = [r for r in results if r.success]
    duration = max((r.end_time for r in results), default=0.0)
    return Summary(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        total_input_tokens=sum(r.prompt_tokens for r in ok),
        total_output_tokens=sum(r.output_tokens for r in ok),
        ttft=LatencyStats.of(t for r in ok if (t := r.ttft) is not None),
        tpot=LatencyStats.of(t for r in ok if (t := r.tpot) is not None),
        itl=LatencyStats.of(x for r in ok for x in r.itl),
        e2el=LatencyStats.of(r.e2e for r in ok),
    )


@attrs.frozen
class BenchmarkResult:
    config: ServeConfig  # with the model resolved
    requests: tuple[RequestResult, ...]
    summary: Summary

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config.to_json(),
            "summary": self.summary.to_json(),
            "requests": [r.to_json() for r in self.requests],
        }


def plot(result: BenchmarkResult, path: str | Path) -> None:
    """TTFT and e2e histograms, ITL over time, latency CDFs; one PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in result.requests if r.success]
    ttft = [1e3 * t for r in ok if (t := r.ttft) is not None]
    e2e = [1e3 * r.e2e for r in ok]
    itl_t = [t for r in ok for t in r.chunk_times[1:]]
    itl = [1e3 * x for r in ok for x in r.itl]
    tpot = [1e3 * t for r in ok if (t := r.tpot) is not None]

    fig = Figure(figsize=(12, 8), layout="constrained")
    FigureCanvasAgg(fig)
    (ax_ttft, ax_e2e), (ax_itl, ax_cdf) = fig.subplots(2, 2)
    s = result.summary
    c = result.config
    rate = "inf" if math.isinf(c.request_rate) else f"{c.request_rate:g}"
    fig.suptitle(
        f"{c.model} @ {c.url}{c.endpoint} - {s.completed} ok / {s.failed} failed, "
        f"rate {rate} req/s, concurrency {c.max_concurrency or 'unbounded'}\n"
        f"{s.request_throughput:.2f} req/s, {s.output_throughput:.1f} output tok/s "
        f"over {s.duration_s:.1f} s"
    )
    for ax, values, title, color in (
        (ax_ttft, ttft, "Time to first token", "tab:blue"),
        (ax_e2e, e2e, "End-to-end latency", "tab:green"),
    ):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("requests")
        if not values:
            continue
        ax.hist(values, bins=min(50, max(5, len(values) // 4)), color=color, alpha=0.8)
        mean, p99 = float(np.mean(values)), float(np.percentile(values, 99))
        ax.axvline(mean, color="black", linewidth=1, label=f"mean {mean:.1f} ms")
        ax.axvline(p99, color="black", ls="--", linewidth=1, label=f"p99 {p99:.1f} ms")
        ax.legend(loc="upper right")

    ax_itl.set_title("Inter-token latency over time")
    ax_itl.set_xlabel("time since start (s)")
    ax_itl.set_ylabel("ms")
    if itl:
        ax_itl.scatter(itl_t, itl, s=2, alpha=0.3, color="tab:orange", rasterized=True)
        if len(itl) >= 20:  # a rolling median shows the trend under the cloud
            order = np.argsort(itl_t)
            xs, ys = np.asarray(itl_t)[order], np.asarray(itl)[order]
            w = max(5, len(ys) // 50)
            at = np.linspace(0, len(ys) - 1, min(len(ys), 200)).astype(int)
            med = [float(np.median(ys[max(0, i - w) : i + w])) for i in at]
            ax_itl.plot(xs[at], med, color="black", linewidth=1, label="rolling median")
            ax_itl.legend(loc="upper right")
        ax_itl.set_ylim(bottom=0, top=max(1e-3, float(np.percentile(itl, 99.5)) * 1.2))

    ax_cdf.set_title("Latency CDFs")
    ax_cdf.set_xlabel("ms (log scale)")
    ax_cdf.set_ylabel("fraction of samples")
    for values, label in ((ttft, "TTFT"), (tpot, "TPOT"), (itl, "ITL"), (e2e, "e2e")):
        pos = np.sort(np.asarray([v for v in values if v > 0]))
        if pos.size:
            ax_cdf.step(pos, np.arange(1, pos.size + 1) / pos.size, label=label)
    if ax_cdf.lines:
        ax_cdf.set_xscale("log")
        ax_cdf.legend(loc="lower right")
    ax_cdf.grid(True, which="both", alpha=0.3)
    fig.savefig(path, dpi=100)
