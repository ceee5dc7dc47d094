"""The runs of ``bench serve --server/--launch`` and their table.

:class:`Comparison` holds every target's :class:`Run` of every round;
its table gives each figure's median over the rounds, then each compared
figure's ratio to the first target (the median of the per-round ratios).
:mod:`structllm.bench.serve_compare` makes the runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import attrs

from structllm.bench.serve_results import BenchmarkResult
from structllm.bench.serve_targets import MemoryReport, Target

__all__ = ["FIGURES", "Comparison", "Run"]

_MIB = 2**20

#: figure -> (label, compared): what the table shows, in its order; ratios
#: only for the compared ones
FIGURES: dict[str, tuple[str, bool]] = {
    "completed": ("Successful requests", False),
    "failed": ("Failed requests", False),
    "request_throughput": ("Request throughput (req/s)", True),
    "output_throughput": ("Output token throughput (tok/s)", True),
    "median_ttft_ms": ("Median TTFT (ms)", True),
    "p99_ttft_ms": ("P99 TTFT (ms)", True),
    "median_tpot_ms": ("Median TPOT (ms)", True),
    "p99_tpot_ms": ("P99 TPOT (ms)", True),
    "median_itl_ms": ("Median ITL (ms)", True),
    "p99_itl_ms": ("P99 ITL (ms)", True),
    "median_e2el_ms": ("Median E2EL (ms)", True),
    "peak_rss_mib": ("Peak RSS, its processes (MiB)", True),
    "rss_mib": ("RSS after the run (MiB)", True),
    "engine_core_peak_rss_mib": ("Engine core peak RSS (MiB)", True),
    "kv_cache_mib": ("KV cache (MiB)", True),
    "spec_decode_acceptance_rate": ("Spec. decode acceptance rate (%)", False),
    "spec_decode_draft_tokens": ("Spec. decode proposed tokens", False),
    "spec_decode_accepted_tokens": ("Spec. decode accepted tokens", False),
}

#: the rows shown only when a target speculated
_SPEC_FIGURES = frozenset(k for k in FIGURES if k.startswith("spec_decode_"))

#: figures shown as whole numbers
_COUNTS = frozenset(
    {"completed", "failed", "spec_decode_draft_tokens", "spec_decode_accepted_tokens"}
)


def _mib(value: float | None) -> float | None:
    return None if value is None else value / _MIB


@attrs.frozen
class Run:
    """One target's run in one round."""

    target: str
    round: int
    result: BenchmarkResult
    memory: MemoryReport

    def figures(self) -> dict[str, float | None]:
        s, m = self.result.summary.to_json(), self.memory
        out: dict[str, float | None] = {k: s[k] for k in FIGURES if k in s}
        out["peak_rss_mib"] = _mib(m.peak_rss_bytes)
        out["rss_mib"] = _mib(m.rss_bytes)
        out["engine_core_peak_rss_mib"] = _mib(m.engine_core_peak_rss_bytes)
        out["kv_cache_mib"] = _mib(m.kv_cache_bytes)
        return out

    def to_json(self) -> dict[str, Any]:
        c = self.result.config
        return {
            "target": self.target,
            "round": self.round,
            "url": c.url,
            "model": c.model,
            "lora_modules": list(c.lora_modules),
            "seed": c.seed,
            "summary": self.result.summary.to_json(),
            "memory": self.memory.to_json(),
            "requests": [r.to_json() for r in self.result.requests],
        }


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


@attrs.frozen
class Comparison:
    """Every run of every target; the table's figures are computed from them."""

    targets: tuple[Target, ...]
    rounds: int
    runs: tuple[Run, ...]

    def runs_of(self, name: str) -> list[Run]:
        return [r for r in self.runs if r.target == name]

    def median(self) -> dict[str, dict[str, float | None]]:
        """Each target's figures, the median over its rounds."""
        out = {}
        for t in self.targets:
            each = [r.figures() for r in self.runs_of(t.name)]
            out[t.name] = {k: _median([f[k] for f in each]) for k in FIGURES}
        return out

    def ratio(self) -> dict[str, dict[str, float | None]]:
        """Each compared figure over the first target's in the same round,
        the median over the rounds (None where either is unknown or 0)."""
        base = {r.round: r.figures() for r in self.runs_of(self.targets[0].name)}
        out = {}
        for t in self.targets:
            per_round: dict[str, list[float | None]] = {}
            for run in self.runs_of(t.name):
                mine, theirs = run.figures(), base.get(run.round, {})
                for k, (_, compared) in FIGURES.items():
                    a, b = mine.get(k), theirs.get(k)
                    if compared:
                        q = a / b if a is not None and b else None
                        per_round.setdefault(k, []).append(q)
            out[t.name] = {k: _median(v) for k, v in per_round.items()}
        return out

    def format(self) -> str:
        names = [t.name for t in self.targets]
        width = max(10, *(len(n) for n in names)) + 2
        label_width = max(len(label) for label, _ in FIGURES.values()) + 2
        rule = "=" * (label_width + width * len(names))
        median, ratio = self.median(), self.ratio()
        head = " ".join(f"{n:>{width - 1}}" for n in names)

        def table(title: str, rows: list[tuple[str, list[str]]]) -> list[str]:
            lines = [f"{f' {title} ':=^{len(rule)}}", f"{'':<{label_width}}{head}"]
            for label, cells in rows:
                lines.append(
                    f"{label:<{label_width}}" + "".join(f"{c:>{width}}" for c in cells)
                )
            return lines

        def cell(value: float | None, key: str) -> str:
            if value is None:
                return "n/a"
            if key == "spec_decode_acceptance_rate":
                return f"{100 * value:.2f}"
            return f"{value:.0f}" if key in _COUNTS else f"{value:.2f}"

        speculated = any(r.result.summary.speculates for r in self.runs)
        values = [
            (label, [cell(median[n][k], k) for n in names])
            for k, (label, _) in FIGURES.items()
            if speculated or k not in _SPEC_FIGURES
        ]
        ratios = [
            (
                label,
                [
                    "n/a" if (v := ratio[n].get(k)) is None else f"{v:.2f}x"
                    for n in names
                ],
            )
            for k, (label, compared) in FIGURES.items()
            if compared
        ]
        rounds = "1 round" if self.rounds == 1 else f"median of {self.rounds} rounds"
        return "\n".join(
            [
                *table(f"Serving Benchmark Comparison ({rounds})", values),
                *table(f"Ratio to {names[0]} (median of per-round ratios)", ratios),
                rule,
            ]
        )

    def to_json(self, config: dict[str, Any]) -> dict[str, Any]:
        return {
            "config": {k: v for k, v in config.items() if k not in ("url", "model")},
            "rounds": self.rounds,
            "targets": [t.to_json() for t in self.targets],
            "runs": [r.to_json() for r in self.runs],
            "median": self.median(),
            "ratio": self.ratio(),
        }
