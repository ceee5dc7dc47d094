"""``structllm bench serve`` against a fake OpenAI-compatible SSE server.

The fake runs in the test's event loop on plain AnyIO sockets (asyncio and
trio): it streams one chunk per ``tokens_per_chunk`` tokens of ``max_tokens``,
the first after ``ttft`` seconds and the rest ``itl`` apart, then a usage
chunk and ``[DONE]``. A ``fail`` function of the request's arrival number
picks the ones that answer HTTP 500, break off with an SSE error, or stall.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import attrs
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from structllm.bench.serve import (
    ServeConfig,
    add_serve_args,
    arrival_times,
    make_requests,
    request_body,
    run_benchmark,
    run_serve,
)
from structllm.bench.serve_results import (
    SPEC_DECODE_KEYS,
    RequestResult,
    SpecDecodeCounts,
    summarize,
)
from structllm.bench.serve_targets import spec_decode_counts
from structllm.testing import sse

TTFT = 0.03
ITL = 0.005


@attrs.define(eq=False)
class FakeServer:
    ttft: float = TTFT
    itl: float = ITL
    tokens_per_chunk: int = 1
    usage: bool = True
    fail: Callable[[int], str | None] = lambda n: None
    #: what GET /metrics answers (404 when None); a function of the fake
    #: gives counters that grow with the requests it has seen
    metrics: str | Callable[[FakeServer], str] | None = None
    url: str = ""
    bodies: list[dict[str, Any]] = attrs.Factory(list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            with contextlib.suppress(
                anyio.BrokenResourceError,
                anyio.ClosedResourceError,
                anyio.EndOfStream,
                anyio.IncompleteRead,  # a client that left mid-request
            ):
                await self._handle(stream)

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        head = (await reader.receive_until(b"\r\n\r\n", 65536)).decode()
        request_line, *header_lines = head.split("\r\n")
        method, path, _ = request_line.split(" ")
        headers = {
            k.strip().lower(): v.strip()
            for k, v in (h.split(":", 1) for h in header_lines)
        }
        n = int(headers.get("content-length", "0"))
        body = json.loads(await reader.receive_exactly(n)) if n else {}
        if (method, path) == ("GET", "/v1/models"):
            await self._send_json(stream, 200, {"data": [{"id": "fake-model"}]})
            return
        if method == "GET":
            metrics = self.metrics(self) if callable(self.metrics) else self.metrics
            found = path == "/metrics" and metrics is not None
            text = metrics if found else "not found"
            await self._send(stream, 200 if found else 404, "text/plain", text or "")
            return
        number = len(self.bodies)
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self._complete(stream, path, body, self.fail(number))
        finally:
            self.in_flight -= 1

    async def _complete(
        self,
        stream: anyio.abc.SocketStream,
        path: str,
        body: dict[str, Any],
        fail: str | None,
    ) -> None:
        if fail == "500":
            await self._send_json(stream, 500, {"error": {"message": "boom"}})
            return
        await stream.send(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Connection: close\r\n\r\n"
        )
        chat = path == "/v1/chat/completions"
        if chat:  # a role-only first chunk carries no text: not the first token
            await self._event(stream, {"choices": [{"delta": {"role": "assistant"}}]})
        max_tokens = body["max_tokens"]
        for i in range(0, max_tokens, self.tokens_per_chunk):
            await anyio.sleep(self.ttft if i == 0 else self.itl)
            if fail == "stall":
                await anyio.sleep_forever()
            if fail == "sse" and i >= 2:
                await self._event(stream, {"error": {"message": "engine died"}})
                return
            text = "x " * min(self.tokens_per_chunk, max_tokens - i)
            choice = {"delta": {"content": text}} if chat else {"text": text}
            await self._event(stream, {"choices": [{"index": 0, **choice}]})
        if self.usage:
            prompt = body["messages"][0]["content"] if chat else body["prompt"]
            plen = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            usage = {"prompt_tokens": plen, "completion_tokens": max_tokens}
            await self._event(stream, {"choices": [], "usage": usage})
        await stream.send(b"data: [DONE]\n\n")

    @staticmethod
    async def _event(stream: anyio.abc.SocketStream, obj: object) -> None:
        await stream.send(f"data: {json.dumps(obj)}\n\n".encode())

    @classmethod
    async def _send_json(
        cls, stream: anyio.abc.SocketStream, status: int, obj: object
    ) -> None:
        await cls._send(stream, status, "application/json", json.dumps(obj))

    @staticmethod
    async def _send(
        stream: anyio.abc.SocketStream, status: int, kind: str, text: str
    ) -> None:
        payload = text.encode()
        await stream.send(
            f"HTTP/1.1 {status} X\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload
        )


@contextlib.asynccontextmanager
async def open_fake_server(**kw: Any) -> AsyncIterator[FakeServer]:
    fake = FakeServer(**kw)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    fake.url = f"http://127.0.0.1:{port}"
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, fake.handle)
        try:
            yield fake
        finally:
            tg.cancel_scope.cancel()


def spec_metrics(fake: FakeServer) -> str:
    """structllm's speculative decoding counters, as if every request had
    had 2 verification steps of 4 proposals with 3 accepted, on top of
    counts from before the benchmark."""
    n = 5 + len(fake.bodies)
    per_request = {"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 6}
    return "".join(
        f"# TYPE structllm_spec_decode_{name} counter\n"
        f"structllm_spec_decode_{name}_total {per * n}.0\n"
        for name, per in per_request.items()
    )


def config(fake: FakeServer, **kw: Any) -> ServeConfig:
    args: dict[str, Any] = {
        "url": fake.url,
        "num_prompts": 12,
        "input_len": (4, 16),
        "output_len": (4, 8),
        "timeout": 10.0,
        **kw,
    }
    return ServeConfig(**args)


# -- pure parts -----------------------------------------------------------------


def test_workload_is_seeded_and_in_range() -> None:
    cfg = ServeConfig(url="http://x", num_prompts=50, input_len=(5, 9), vocab_size=40)
    specs = make_requests(cfg)
    assert specs == make_requests(cfg)
    assert specs != make_requests(attrs.evolve(cfg, seed=1))
    for s in specs:
        assert isinstance(s.prompt, tuple)
        assert 5 <= len(s.prompt) == s.prompt_len <= 9
        assert all(3 <= t < 40 for t in s.prompt)
        assert 16 <= s.max_tokens <= 128
    text = make_requests(attrs.evolve(cfg, prompt_kind="text"))
    assert all(isinstance(s.prompt, str) for s in text)
    assert [len(str(s.prompt).split()) for s in text] == [s.prompt_len for s in text]


def test_requests_spread_over_the_lora_modules_from_the_seed() -> None:
    """vLLM's ``--lora-modules``: each request's model is one of the names,
    drawn from the seed; the prompts are those of the base-model workload."""
    names = ("a0", "a1", "a2", "a3")
    base = ServeConfig(url="http://x", num_prompts=400)
    cfg = attrs.evolve(base, lora_modules=names)
    specs = make_requests(cfg)
    models = [s.model for s in specs]
    assert models == [s.model for s in make_requests(cfg)]
    assert models != [s.model for s in make_requests(attrs.evolve(cfg, seed=1))]
    counts = {n: models.count(n) for n in names}
    assert sum(counts.values()) == 400 and min(counts.values()) > 70, counts
    assert models[:8] != sorted(models[:8])  # drawn, not dealt in turn
    plain = make_requests(base)
    assert [s.model for s in plain] == [None] * 400
    assert [attrs.evolve(s, model=None) for s in specs] == plain
    assert request_body(specs[0], cfg, "base")["model"] == specs[0].model
    assert request_body(plain[0], base, "base")["model"] == "base"


def test_poisson_arrivals_are_reproducible() -> None:
    a = arrival_times(2000, 10.0, seed=3)
    assert a == arrival_times(2000, 10.0, seed=3)
    assert a != arrival_times(2000, 10.0, seed=4)
    assert a[0] == 0.0
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert min(gaps) >= 0
    assert 0.09 < sum(gaps) / len(gaps) < 0.11  # mean 1 / rate
    # exponential: the standard deviation equals the mean
    mean = sum(gaps) / len(gaps)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert 0.8 < std / mean < 1.2
    assert arrival_times(5, math.inf, seed=0) == [0.0] * 5


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="prompt_kind 'tokens'"):
        ServeConfig(url="http://x", endpoint="/v1/chat/completions")
    with pytest.raises(ValueError, match="input_len"):
        ServeConfig(url="http://x", input_len=(8, 4))
    with pytest.raises(ValueError, match="max_concurrency"):
        ServeConfig(url="http://x", max_concurrency=0)


def test_summary_figures() -> None:
    fast = RequestResult(
        index=0,
        prompt_tokens=10,
        max_tokens=3,
        send_time=0.0,
        end_time=0.5,
        chunk_times=(0.1, 0.3, 0.5),
        output_tokens=3,
    )
    slow = attrs.evolve(
        fast, index=1, send_time=1.0, end_time=2.0, chunk_times=(1.2, 1.4, 2.0)
    )
    failed = attrs.evolve(fast, index=2, end_time=4.0, error="HTTP 500: boom")
    s = summarize([fast, slow, failed])
    assert (s.completed, s.failed) == (2, 1)
    assert s.duration_s == 4.0
    assert (s.total_input_tokens, s.total_output_tokens) == (20, 6)
    assert s.request_throughput == pytest.approx(0.5)
    assert s.output_throughput == pytest.approx(1.5)
    assert s.total_token_throughput == pytest.approx(6.5)
    assert s.ttft is not None and s.ttft.mean_ms == pytest.approx(150)
    # TPOT = (e2e - ttft) / (tokens - 1): (0.5 - 0.1) / 2 and (1.0 - 0.2) / 2
    assert s.tpot is not None and s.tpot.mean_ms == pytest.approx(300)
    assert s.itl is not None and s.itl.median_ms == pytest.approx(200)
    assert s.e2el is not None and s.e2el.p99_ms == pytest.approx(995)
    table = s.format()
    for label in ("Successful requests:", "Mean TTFT (ms):", "P99 E2EL (ms):"):
        assert label in table
    none = summarize([failed])
    assert none.ttft is None and none.to_json()["mean_ttft_ms"] is None
    assert "n/a" in none.format()


def test_spec_decode_counters_of_structllm_and_vllm() -> None:
    vllm = """\
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 2.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 99.0
"""
    assert spec_decode_counts(vllm) == SpecDecodeCounts(12, 40, 30)
    assert spec_decode_counts(spec_metrics(FakeServer())) == SpecDecodeCounts(
        10, 40, 30
    )
    # llama.cpp's /metrics: other counters only; and a page that is no metrics
    llamacpp = "# TYPE llamacpp:tokens_predicted_total counter\n"
    llamacpp += "llamacpp:tokens_predicted_total 7\n"
    assert spec_decode_counts(llamacpp) is None
    assert spec_decode_counts("<html>not found</html>") is None
    run = SpecDecodeCounts(12, 40, 30) - SpecDecodeCounts(2, 8, 6)
    assert run == SpecDecodeCounts(10, 32, 24)
    assert run.acceptance_rate == pytest.approx(0.75)
    assert run.acceptance_length == pytest.approx(1 + 24 / 10)
    idle = SpecDecodeCounts(0, 0, 0)
    assert idle.acceptance_rate is None and idle.acceptance_length is None


def test_summary_shows_speculation_only_where_the_server_speculated() -> None:
    r = RequestResult(0, 10, 3, 0.0, 0.5, (0.1, 0.3, 0.5), 3)
    plain = summarize([r])
    assert plain.spec_decode is None and not plain.speculates
    assert all(plain.to_json()[k] is None for k in SPEC_DECODE_KEYS)
    assert "Speculative Decoding" not in plain.format()
    idle = attrs.evolve(plain, spec_decode=SpecDecodeCounts(0, 0, 0))
    assert not idle.speculates and "Acceptance" not in idle.format()
    spec = attrs.evolve(plain, spec_decode=SpecDecodeCounts(4, 16, 12))
    table = spec.format()
    assert "Speculative Decoding" in table
    assert "Acceptance rate (%):                     75.00" in table
    assert "Acceptance length:                       4.00" in table
    assert "Draft tokens:                            16" in table
    assert "Accepted tokens:                         12" in table
    assert spec.to_json()["spec_decode_acceptance_rate"] == 0.75


# -- against the fake server ------------------------------------------------------


@pytest.mark.anyio
async def test_counts_tokens_and_timings() -> None:
    async with open_fake_server() as fake:
        result = await run_benchmark(config(fake))
    s = result.summary
    assert result.config.model == "fake-model"  # from GET /v1/models
    assert (s.completed, s.failed) == (12, 0)
    assert len(fake.bodies) == 12
    specs = make_requests(result.config)
    for r, spec in zip(result.requests, specs, strict=True):
        assert r.output_tokens == r.max_tokens == spec.max_tokens
        assert len(r.chunk_times) == r.output_tokens
        assert r.prompt_tokens == spec.prompt_len
    for body in fake.bodies:
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["temperature"] == 0
        assert body["model"] == "fake-model"
    assert sorted(b["max_tokens"] for b in fake.bodies) == sorted(
        sp.max_tokens for sp in specs
    )
    assert s.total_output_tokens == sum(sp.max_tokens for sp in specs)
    assert s.total_input_tokens == sum(sp.prompt_len for sp in specs)
    # the fake's delays bound the figures below; the upper bounds are generous
    for r in result.requests:
        assert r.ttft is not None and 0.9 * TTFT <= r.ttft < TTFT + 1.0
        assert 0.9 * (TTFT + (r.output_tokens - 1) * ITL) <= r.e2e < 2.0
    assert s.itl is not None and 0.5 * ITL * 1e3 <= s.itl.median_ms < 500
    assert s.tpot is not None and 0.5 * ITL * 1e3 <= s.tpot.mean_ms < 500
    assert 0 < s.duration_s < 3.0
    assert s.output_throughput == pytest.approx(s.total_output_tokens / s.duration_s)


@pytest.mark.anyio
async def test_spec_decode_counts_are_the_runs_difference() -> None:
    async with open_fake_server(metrics=spec_metrics) as fake:
        result = await run_benchmark(config(fake))
    # 12 requests, each 2 drafts of 4 tokens, 3 accepted; the counts from
    # before the run are not the run's
    assert result.summary.spec_decode == SpecDecodeCounts(24, 96, 72)
    assert "Acceptance rate (%):                     75.00" in result.summary.format()
    async with open_fake_server() as fake:  # no /metrics
        result = await run_benchmark(config(fake))
    assert result.summary.spec_decode is None


@pytest.mark.anyio
async def test_usage_counts_tokens_not_chunks() -> None:
    async with open_fake_server(tokens_per_chunk=2) as fake:
        result = await run_benchmark(config(fake, model="m"))
    for r in result.requests:
        assert r.output_tokens == r.max_tokens
        assert len(r.chunk_times) == math.ceil(r.max_tokens / 2)
    async with open_fake_server(tokens_per_chunk=2, usage=False) as fake:
        result = await run_benchmark(config(fake, model="m"))
    for r in result.requests:
        assert r.output_tokens == len(r.chunk_times) == math.ceil(r.max_tokens / 2)


@pytest.mark.anyio
async def test_chat_endpoint_with_text_prompts() -> None:
    async with open_fake_server() as fake:
        result = await run_benchmark(
            config(fake, endpoint="/v1/chat/completions", prompt_kind="text")
        )
    assert result.summary.completed == 12
    for body in fake.bodies:
        (message,) = body["messages"]
        assert message["role"] == "user" and isinstance(message["content"], str)
    for r in result.requests:  # the empty role chunk did not count
        assert len(r.chunk_times) == r.output_tokens == r.max_tokens
        assert r.ttft is not None and r.ttft >= 0.9 * TTFT


def by_number(n: int) -> str | None:
    return {1: "500", 2: "sse"}.get(n % 4)


@pytest.mark.anyio
async def test_failures_are_counted() -> None:
    async with open_fake_server(fail=by_number) as fake:
        result = await run_benchmark(config(fake))
    s = result.summary
    assert (s.completed, s.failed) == (6, 6)
    errors = sorted(r.error for r in result.requests if r.error is not None)
    assert errors == ["HTTP 500: boom"] * 3 + ["SSE error: engine died"] * 3
    assert (
        sorted(r.status for r in result.requests if not r.success)
        == [200] * 3 + [500] * 3
    )
    ok = [r for r in result.requests if r.success]
    assert s.total_output_tokens == sum(r.max_tokens for r in ok)
    assert s.total_input_tokens == sum(r.prompt_tokens for r in ok)


@pytest.mark.anyio
async def test_timeout_and_refused_connections_fail_requests() -> None:
    async with open_fake_server(fail=lambda n: "stall" if n == 0 else None) as fake:
        result = await run_benchmark(config(fake, num_prompts=3, timeout=0.3))
    (late,) = [r for r in result.requests if not r.success]
    assert late.error == "timed out after 0.3 s"
    assert 0.3 <= late.e2e < 1.5

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    cfg = ServeConfig(url=f"http://127.0.0.1:{port}", model="m", num_prompts=3)
    result = await run_benchmark(cfg)
    assert result.summary.failed == 3
    assert all(str(r.error).startswith("ConnectError") for r in result.requests)


@pytest.mark.anyio
async def test_max_concurrency_caps_requests_in_flight() -> None:
    async with open_fake_server() as fake:
        result = await run_benchmark(config(fake, max_concurrency=3))
    assert result.summary.completed == 12
    assert fake.max_in_flight == 3


@pytest.mark.anyio
async def test_poisson_send_times_follow_the_schedule() -> None:
    async with open_fake_server() as fake:
        cfg = config(fake, model="m", num_prompts=10, request_rate=50.0, seed=7)
        result = await run_benchmark(cfg)
    schedule = arrival_times(10, 50.0, seed=7)
    for r, at in zip(result.requests, schedule, strict=True):
        assert at <= r.send_time + 1e-3 < at + 0.5


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(argv)


def test_flags() -> None:
    ns = parse(["--request-rate", "inf", "--input-len", "3", "9"])
    cfg = ServeConfig.from_namespace(ns)
    assert cfg.url == "http://127.0.0.1:8000"
    assert math.isinf(cfg.request_rate) and cfg.input_len == (3, 9)
    assert (cfg.num_prompts, cfg.endpoint, cfg.prompt_kind) == (
        200,
        "/v1/completions",
        "tokens",
    )
    assert ServeConfig.from_namespace(parse([])) == ServeConfig()  # one home each
    chat = ServeConfig.from_namespace(parse(["--endpoint", "/v1/chat/completions"]))
    assert chat.prompt_kind == "text"
    bad = parse(["--endpoint", "/v1/chat/completions", "--prompt-kind", "tokens"])
    assert run_serve(bad) == 2
    lora = ServeConfig.from_namespace(parse(["--lora-modules", "a", "b"]))
    assert lora.lora_modules == ("a", "b")
    assert run_serve(parse(["--lora-modules", "a", "--lora-targets", "x"])) == 2


@pytest.mark.anyio
async def test_lora_requests_name_their_adapters() -> None:
    async with open_fake_server() as fake:
        cfg = config(fake, num_prompts=40, lora_modules=("x", "y"))
        result = await run_benchmark(cfg)
    assert result.summary.completed == 40
    assert result.config.model == "fake-model"
    sent = [b["model"] for b in fake.bodies]
    assert sorted(set(sent)) == ["x", "y"]
    # the bodies arrive in any order; each prompt went with its spec's model
    by_prompt = {json.dumps(b["prompt"]): b["model"] for b in fake.bodies}
    for spec in make_requests(cfg):
        assert by_prompt[json.dumps(list(spec.prompt))] == spec.model


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_run_serve_prints_and_writes_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    async with open_fake_server(fail=lambda n: "500" if n == 5 else None) as fake:
        argv = ["--url", fake.url, "--num-prompts", "40", "--request-rate", "200"]
        argv += ["--max-concurrency", "8", "--output-len", "4", "12"]
        argv += ["--json", str(out), "--plot", str(png)]
        # run_serve runs its own event loop: give it a thread
        rc = await anyio.to_thread.run_sync(run_serve, parse(argv))
    assert rc == 0
    table = capsys.readouterr().out
    assert "Successful requests:                     39" in table
    assert "Failed requests:                         1" in table
    data = json.loads(out.read_text())
    assert set(data) == {"config", "summary", "requests"}
    assert data["config"]["model"] == "fake-model"
    assert data["config"]["max_concurrency"] == 8
    assert {
        "completed",
        "failed",
        "duration_s",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_tpot_ms",
        "p99_itl_ms",
        "p99_e2el_ms",
    } <= set(data["summary"])
    assert data["summary"]["completed"] == 39
    assert len(data["requests"]) == 40
    assert {
        "index",
        "success",
        "error",
        "send_time",
        "ttft",
        "e2e",
        "chunk_times",
        "itl",
        "output_tokens",
    } <= set(data["requests"][0])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_shared_sse_reader_says_how_a_stream_ended() -> None:
    body = 'data: {"a": 1}\n\n: comment\n\ndata: [DONE]\n\n'
    assert sse.data_events(body.splitlines()) == ['{"a": 1}', sse.DONE]
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
    assert sse.outcome(head + body.encode()) == "200-done"
    assert sse.outcome(head + b'data: {"a": 1}\n\n') == "200-truncated"
    busy = b'HTTP/1.1 503 X\r\nretry-after: 1\r\n\r\n{"error": {}}'
    assert sse.outcome(busy) == "503-clean"
    assert sse.outcome(busy.replace(b"retry-after: 1\r\n", b"")) == "503-unclean"
    assert sse.outcome(b"") == "closed-without-response"
    request = sse.request_bytes({"prompt": "x"})
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert request.endswith(b'\r\n\r\n{"prompt": "x"}')
