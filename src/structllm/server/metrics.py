"""Prometheus metrics in the text exposition format, without a global registry.

Each server builds its own :class:`Metrics`; ``render()`` writes the
exposition text, sampling the engine's gauges at scrape time.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

import attrs

__all__ = ["Counter", "Histogram", "Metrics"]

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


@attrs.define(eq=False)
class Histogram:
    name: str
    help: str
    buckets: Sequence[float] = _LATENCY_BUCKETS
    _counts: list[int] = attrs.field(init=False)
    _sum: float = 0.0
    _count: int = 0

    def __attrs_post_init__(self) -> None:
        self._counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self._sum += value
        self._count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip((*self.buckets, math.inf), self._counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == math.inf else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {cumulative}')
        lines.append(f"{self.name}_sum {self._sum}")
        lines.append(f"{self.name}_count {self._count}")
        return lines


@attrs.define(eq=False)
class Counter:
    name: str
    help: str
    _values: dict[str, float] = attrs.Factory(dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        self._values[key] = self._values.get(key, 0.0) + amount

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key, value in sorted(self._values.items()):
            lines.append(
                f"{self.name}{{{key}}} {value}" if key else f"{self.name} {value}"
            )
        if not self._values:
            lines.append(f"{self.name} 0")
        return lines


@attrs.define(eq=False)
class Metrics:
    """The server's metrics; ``gauges`` sample the engine when scraped."""

    gauges: Callable[[], dict[str, tuple[str, float]]]
    prefix: str = "structllm"
    ttft: Histogram = attrs.field(init=False)
    itl: Histogram = attrs.field(init=False)
    e2e: Histogram = attrs.field(init=False)
    queue: Histogram = attrs.field(init=False)
    requests: Counter = attrs.field(init=False)
    prompt_tokens: Counter = attrs.field(init=False)
    generation_tokens: Counter = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        p = self.prefix
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds", "Time to first token."
        )
        self.itl = Histogram(
            f"{p}_inter_token_latency_seconds", "Time between outputs."
        )
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "End-to-end latency.")
        self.queue = Histogram(
            f"{p}_request_queue_time_seconds", "Arrival to first token, minus prefill."
        )
        self.requests = Counter(f"{p}_requests_total", "Finished requests by reason.")
        self.prompt_tokens = Counter(f"{p}_prompt_tokens_total", "Prompt tokens.")
        self.generation_tokens = Counter(
            f"{p}_generation_tokens_total", "Generated tokens."
        )

    def render(self) -> str:
        lines: list[str] = []
        for name, (help_, value) in self.gauges().items():
            full = f"{self.prefix}_{name}"
            lines += [
                f"# HELP {full} {help_}",
                f"# TYPE {full} gauge",
                f"{full} {value}",
            ]
        for m in (self.requests, self.prompt_tokens, self.generation_tokens):
            lines += m.render()
        for h in (self.ttft, self.itl, self.e2e, self.queue):
            lines += h.render()
        return "\n".join(lines) + "\n"
