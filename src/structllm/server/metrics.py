"""The server's Prometheus metrics, on ``prometheus-client`` with its own registry.

Each server builds its own :class:`Metrics` with a fresh
``CollectorRegistry`` (never the process-global one, so two servers, or
tests, in one process do not share counts). Latency histograms and token
counters are updated as requests run; the engine gauges are sampled from
``gauges()`` at scrape time by a collector, and the server process's own
(``process_resident_memory_bytes``, CPU seconds, ...) by prometheus-client's
process collector. ``render()`` is the text exposition for ``GET /metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs
from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from structllm.outputs import RequestOutput

__all__ = ["CONTENT_TYPE", "Gauges", "Metrics"]

#: the exposition format ``render()`` writes
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

#: metric name (without the prefix) -> (help, value), sampled at scrape time;
#: a name ending in ``_total`` is a counter, any other a gauge
Gauges = Callable[[], dict[str, tuple[str, float]]]

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


@attrs.frozen
class _GaugeCollector(Collector):
    """Samples ``gauges()`` each time the registry is collected."""

    gauges: Gauges
    prefix: str

    def collect(self) -> Iterator[Metric]:
        for name, (help_, value) in self.gauges().items():
            if name.endswith("_total"):  # a count that only grows: a counter
                family = f"{self.prefix}_{name.removesuffix('_total')}"
                yield CounterMetricFamily(family, help_, value=value)
            else:
                yield GaugeMetricFamily(f"{self.prefix}_{name}", help_, value=value)


@attrs.frozen
class _WithoutCreated(Collector):
    """The registry's metrics less the ``*_created`` samples.

    prometheus-client adds a creation timestamp to every counter and
    histogram; the exposition stays what it was before it (and what vLLM
    sends) without them, and this needs no process-global switch.
    """

    registry: CollectorRegistry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            metric.samples = [
                s for s in metric.samples if not s.name.endswith("_created")
            ]
            yield metric


@attrs.define(eq=False)
class Metrics:
    """The server's metrics; ``gauges`` sample the engine when scraped."""

    gauges: Gauges
    prefix: str = "structllm"
    registry: CollectorRegistry = attrs.field(init=False)
    ttft: Histogram = attrs.field(init=False)
    itl: Histogram = attrs.field(init=False)
    e2e: Histogram = attrs.field(init=False)
    queue: Histogram = attrs.field(init=False)
    requests: Counter = attrs.field(init=False)
    prompt_tokens: Counter = attrs.field(init=False)
    generation_tokens: Counter = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        p, r = self.prefix, CollectorRegistry()
        self.registry = r

        def histogram(name: str, help_: str) -> Histogram:
            return Histogram(f"{p}_{name}", help_, registry=r, buckets=_LATENCY_BUCKETS)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between outputs.")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end latency.")
        self.queue = histogram(
            "request_queue_time_seconds", "Arrival to first token, minus prefill."
        )
        self.requests = Counter(
            f"{p}_requests_total",
            "Finished requests by reason.",
            ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{p}_prompt_tokens_total", "Prompt tokens.", registry=r
        )
        self.generation_tokens = Counter(
            f"{p}_generation_tokens_total", "Generated tokens.", registry=r
        )
        r.register(_GaugeCollector(self.gauges, p))
        # this (the server's) process: process_resident_memory_bytes, CPU
        # seconds, open fds, as Prometheus' clients name them (Linux only)
        ProcessCollector(registry=r)

    def record_finished(self, result: RequestOutput, e2e: float) -> None:
        """Count one finished request (``e2e``: seconds since it arrived)."""
        self.e2e.observe(e2e)
        if result.queue_time is not None:
            self.queue.observe(result.queue_time)
        self.requests.labels(finished_reason=str(result.finish_reason)).inc()
        self.prompt_tokens.inc(len(result.prompt_token_ids))
        self.generation_tokens.inc(len(result.token_ids))

    def render(self) -> str:
        """The text exposition of every metric (format :data:`CONTENT_TYPE`)."""
        return generate_latest(_WithoutCreated(self.registry)).decode()
