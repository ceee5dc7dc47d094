"""The server's Prometheus metrics: names, labels, per-server registries.

The exposition is parsed back with prometheus-client's own parser, so the
test checks what a Prometheus server would read, not string details.
"""

from __future__ import annotations

import sys

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from structllm.outputs import CompletionOutput, FinishReason, RequestOutput
from structllm.server.metrics import CONTENT_TYPE, Metrics

GAUGES = {
    "num_requests_running": ("Requests in the running batch.", 2.0),
    "kv_cache_usage_perc": ("Fraction of KV-cache blocks in use.", 0.25),
}


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render()):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def finished(reason: FinishReason, prompt: int, generated: int) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=tuple(range(prompt)),
        outputs=(
            CompletionOutput(
                index=0,
                text="",
                token_ids=tuple(range(generated)),
                finish_reason=reason,
            ),
        ),
        finished=True,
        queue_time=0.002,
    )


def test_families_and_types() -> None:
    m = Metrics(lambda: GAUGES)
    families = {f.name: f.type for f in text_string_to_metric_families(m.render())}
    p = "structllm_"
    # the server process's own, where /proc has them
    process = {k: families.pop(k) for k in list(families) if k.startswith("process_")}
    if sys.platform == "linux":
        assert process["process_resident_memory_bytes"] == "gauge"
        assert process["process_cpu_seconds"] == "counter"
    assert families == {
        p + "num_requests_running": "gauge",
        p + "kv_cache_usage_perc": "gauge",
        p + "requests": "counter",
        p + "prompt_tokens": "counter",
        p + "generation_tokens": "counter",
        p + "time_to_first_token_seconds": "histogram",
        p + "inter_token_latency_seconds": "histogram",
        p + "e2e_request_latency_seconds": "histogram",
        p + "request_queue_time_seconds": "histogram",
    }
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_finished_requests_are_counted_by_reason() -> None:
    m = Metrics(lambda: {})
    m.record_finished(finished("length", 5, 3), e2e=0.3)
    m.record_finished(finished("abort", 2, 1), e2e=0.05)
    m.record_finished(finished("length", 1, 1), e2e=0.01)
    m.ttft.observe(0.02)
    got = samples(m)
    p = "structllm_"
    assert got[p + "requests_total", (("finished_reason", "length"),)] == 2
    assert got[p + "requests_total", (("finished_reason", "abort"),)] == 1
    assert got[p + "prompt_tokens_total", ()] == 8
    assert got[p + "generation_tokens_total", ()] == 5
    assert got[p + "e2e_request_latency_seconds_count", ()] == 3
    assert got[p + "request_queue_time_seconds_count", ()] == 3
    assert got[p + "time_to_first_token_seconds_count", ()] == 1
    # cumulative buckets with the same bounds as before prometheus-client
    e2e = p + "e2e_request_latency_seconds_bucket"
    assert got[e2e, (("le", "0.01"),)] == 1
    assert got[e2e, (("le", "0.1"),)] == 2
    assert got[e2e, (("le", "+Inf"),)] == 3
    assert not any(name.endswith("_created") for name, _ in got)


def test_gauges_are_sampled_at_scrape_time() -> None:
    value = {"running": 0.0}
    m = Metrics(lambda: {"num_requests_running": ("Running.", value["running"])})
    assert samples(m)["structllm_num_requests_running", ()] == 0
    value["running"] = 7
    assert samples(m)["structllm_num_requests_running", ()] == 7


def test_each_server_has_its_own_registry() -> None:
    a, b = Metrics(lambda: {}), Metrics(lambda: {})
    a.record_finished(finished("stop", 1, 1), e2e=0.1)
    key = ("structllm_requests_total", (("finished_reason", "stop"),))
    assert samples(a)[key] == 1 and key not in samples(b)
    assert a.registry is not b.registry
    global_names = {
        f.name for f in prometheus_client.REGISTRY.collect()
    }  # never registered globally
    assert not any(n.startswith("structllm_") for n in global_names)
