"""``structllm bench serve``: load-test any OpenAI-compatible server.

Like ``vllm bench serve``: ``--num-prompts`` requests, with random prompts and
output lengths drawn from ``--seed``, arrive as a Poisson process at
``--request-rate`` per second (``inf``: all at once), at most
``--max-concurrency`` in flight. Each request streams (``stream: true``,
``ignore_eos: true``, ``temperature: 0``); the client notes when every chunk
with text arrives and reports, in milliseconds, mean / median / p99 of

- TTFT, time to first token: send to the first chunk with non-empty text;
- TPOT, time per output token: ``(e2e - ttft) / (output_tokens - 1)``, over
  requests with more than one output token;
- ITL, inter-token latency: the gaps between successive chunks with text
  (one chunk usually carries one token);
- e2e latency: send to the end of the stream;

plus request and token throughput over the benchmark's duration, and, where
the server speculates, its acceptance rate and proposed / accepted tokens:
its ``/metrics`` counters read before and after the run (the difference;
n/a for a server without them, such as llama.cpp). A request
fails on an HTTP error status, a transport error, an SSE ``error`` object, a
stream with no text, or ``--timeout``; failures are counted, not raised.

``--json PATH`` writes one object::

    {"config":   ServeConfig fields (the resolved model included),
     "summary":  Summary.to_json(): completed, failed, duration_s,
                 total_input_tokens, total_output_tokens, request_throughput,
                 output_throughput, total_token_throughput,
                 {mean,median,p99}_{ttft,tpot,itl,e2el}_ms (null if no data),
                 and spec_decode_{acceptance_rate,acceptance_length,drafts,
                 draft_tokens,accepted_tokens} (null without the counters),
     "requests": RequestResult.to_json() per request: index, success, status,
                 error, prompt_tokens, max_tokens, output_tokens, send_time,
                 end_time, ttft, e2e, chunk_times, itl (seconds; times are
                 from the benchmark's start)}

``--lora-modules NAME ...`` spreads the requests over a server's LoRA
adapters: each one's ``model`` is one of the names, drawn from ``--seed``.

``--plot PATH.png`` draws the TTFT and e2e histograms, ITL over time and the
latency CDFs (matplotlib, imported only then).

``--server NAME=URL`` and ``--launch NAME=COMMAND`` (instead of ``--url``)
send the same workload to several servers, one at a time, and print one
table with their memory: :mod:`structllm.bench.serve_compare`.

The client is httpx with no connection cap of its own (``--max-concurrency``
is the only one) and ``trust_env=False``: no proxy sits between the benchmark
and the server.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import attrs
import httpx
import numpy as np

from structllm.bench.serve_client import (
    Progress,
    discover_model,
    discover_model_at,
    open_client,
    stream_request,
)
from structllm.bench.serve_results import (
    BenchmarkResult,
    RequestResult,
    plot,
    summarize,
)
from structllm.bench.serve_targets import scrape_spec_decode
from structllm.config import add_arguments, from_arguments, setting

__all__ = [
    "RequestSpec",
    "ServeConfig",
    "add_serve_args",
    "arrival_times",
    "discover_model",
    "make_requests",
    "run_benchmark",
    "run_serve",
]

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")

# Text prompts are random words from this text (roughly one token each).
_WORD_TEXT = """
the of and to in is it that was for on are with as his they be at one have
this from or had by hot word but what some we can out other were all there
when up use your how said an each she which do their time if will way about
many then them write would like so these her long make thing see him two has
look more day could go come did number sound no most people my over know water
than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every
good me give our under name very through just form
"""
_WORDS = tuple(_WORD_TEXT.split())


def _strip_slash(url: str) -> str:
    return url.rstrip("/")


def _length_range(value: Sequence[int]) -> tuple[int, int]:
    lo, hi = (int(v) for v in value)
    return lo, hi


def _check_range(
    self: ServeConfig, attribute: attrs.Attribute[tuple[int, int]], v: tuple[int, int]
) -> None:
    if not 1 <= v[0] <= v[1]:
        raise ValueError(f"{attribute.name} must be MIN MAX with 1 <= MIN <= MAX: {v}")


def _check_concurrency(
    self: ServeConfig, attribute: attrs.Attribute[int | None], v: int | None
) -> None:
    if v is not None and v < 1:
        raise ValueError(f"max_concurrency must be at least 1: {v}")


@attrs.frozen
class ServeConfig:
    """What to send, where and how fast; each field is a flag of ``bench serve``."""

    url: str = setting(
        "http://127.0.0.1:8000", help="server base URL (no /v1)", converter=_strip_slash
    )
    model: str | None = setting(
        None, help="model name (default: first of GET /v1/models)"
    )
    endpoint: Literal["/v1/completions", "/v1/chat/completions"] = setting(
        "/v1/completions",
        help="the API to load",
        validator=attrs.validators.in_(ENDPOINTS),
    )
    num_prompts: int = setting(
        200, help="requests to send", validator=attrs.validators.ge(1)
    )
    request_rate: float = setting(
        math.inf,
        help="Poisson arrivals per second; inf sends everything at once",
        validator=attrs.validators.gt(0.0),
    )
    max_concurrency: int | None = setting(
        None, help="cap on requests in flight", validator=_check_concurrency
    )
    input_len: tuple[int, int] = setting(
        (32, 256),
        help="prompt lengths (tokens or words), drawn uniformly",
        converter=_length_range,
        validator=_check_range,
        metavar=("MIN", "MAX"),
    )
    output_len: tuple[int, int] = setting(
        (16, 128),
        help="max_tokens of each request, drawn uniformly",
        converter=_length_range,
        validator=_check_range,
        metavar=("MIN", "MAX"),
    )
    seed: int = setting(0, help="seed of the prompts, lengths and arrivals")
    prompt_kind: Literal["tokens", "text"] = setting(
        "tokens", validator=attrs.validators.in_(("tokens", "text"))
    )
    vocab_size: int = setting(
        256,
        help="token ids are drawn in [3, this)",
        validator=attrs.validators.gt(3),
    )
    timeout: float = setting(
        3600.0,
        help="seconds per request, in all (inf: none)",
        validator=attrs.validators.gt(0.0),
    )
    lora_modules: tuple[str, ...] = setting(
        (),
        help="LoRA adapters the server serves: each request's model is one of "
        "these names, drawn from --seed (as vLLM's benchmark does)",
        metavar="NAME",
        many=True,
    )

    def __attrs_post_init__(self) -> None:
        if self.prompt_kind == "tokens" and self.endpoint != "/v1/completions":
            raise ValueError(
                f"prompt_kind 'tokens' needs endpoint /v1/completions, not "
                f"{self.endpoint}; use prompt_kind 'text'"
            )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServeConfig:
        """The config :func:`add_serve_args`'s flags give; ``prompt_kind``
        follows the endpoint unless given."""
        kind = ns.prompt_kind or ("tokens" if ns.endpoint == ENDPOINTS[0] else "text")
        config: ServeConfig = from_arguments(cls, ns, prompt_kind=kind)
        return config

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        for key in ("request_rate", "timeout"):  # JSON has no infinity
            d[key] = "inf" if math.isinf(d[key]) else d[key]
        return d


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """``bench serve``'s flags: :class:`ServeConfig`'s fields, and the outputs."""
    add_arguments(
        p,
        ServeConfig,
        defaults={"prompt_kind": None},
        help={
            "prompt_kind": "token-id lists or random words (default: tokens for "
            "completions, text for chat)"
        },
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="draw a figure")
    from structllm.bench.serve_compare import add_compare_args

    add_compare_args(p)


# -- workload: pure and seeded ------------------------------------------------


@attrs.frozen
class RequestSpec:
    """One request of the workload, before it is sent."""

    index: int
    prompt: tuple[int, ...] | str
    prompt_len: int
    max_tokens: int
    #: the LoRA adapter it names as its model (None: the config's model)
    model: str | None = None


def make_requests(config: ServeConfig) -> list[RequestSpec]:
    """``config.num_prompts`` requests, deterministic in ``config.seed``.

    With ``config.lora_modules`` each names one of them, drawn uniformly from
    a seeded stream of its own: the prompts are the same with or without
    adapters, so a base-model run and an adapter run compare like for like.
    """
    rng = np.random.default_rng(config.seed)
    names = config.lora_modules
    picks = np.random.default_rng([2, config.seed]).integers(
        0, max(1, len(names)), size=config.num_prompts
    )
    specs = []
    for i in range(config.num_prompts):
        plen = int(rng.integers(config.input_len[0], config.input_len[1] + 1))
        olen = int(rng.integers(config.output_len[0], config.output_len[1] + 1))
        prompt: tuple[int, ...] | str
        if config.prompt_kind == "tokens":
            prompt = tuple(rng.integers(3, config.vocab_size, size=plen).tolist())
        else:
            prompt = " ".join(_WORDS[j] for j in rng.integers(0, len(_WORDS), plen))
        model = names[picks[i]] if names else None
        specs.append(RequestSpec(i, prompt, plen, olen, model))
    return specs


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of a Poisson process at ``rate``/s.

    The first request goes at 0; the gaps after it are exponential with mean
    ``1 / rate`` from their own seeded stream, so the prompts do not change
    with the rate. ``rate = inf`` sends everything at 0.
    """
    if n == 0 or math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng([1, seed]).exponential(1.0 / rate, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def request_body(spec: RequestSpec, config: ServeConfig, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": spec.model or model,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        p = spec.prompt
        body["prompt"] = list(p) if isinstance(p, tuple) else p
    return body


async def run_benchmark(config: ServeConfig) -> BenchmarkResult:
    """Send the workload; every request's outcome is recorded, none raises.

    Transport and protocol errors become failed ``RequestResult``s. Only
    model discovery (``config.model is None``) can raise: ``httpx.HTTPError``
    or ``ValueError``. The server's speculative decoding counters are read
    before the first request and after the last.
    """
    specs = make_requests(config)
    times = arrival_times(config.num_prompts, config.request_rate, config.seed)
    results: list[RequestResult | None] = [None] * len(specs)
    limit = anyio.CapacityLimiter(config.max_concurrency or len(specs))
    url = config.url + config.endpoint
    deadline = config.timeout
    async with open_client() as client:
        model = config.model or await discover_model(client, config.url)
        config = attrs.evolve(config, model=model)
        spec_before = await scrape_spec_decode(client, config.url)

        async def one(spec: RequestSpec, start: float) -> None:
            async with limit:
                body = request_body(spec, config, model)
                seen = Progress()
                send = time.perf_counter() - start
                with anyio.move_on_after(deadline) as scope:
                    await stream_request(client, url, body, start, seen)
                end = time.perf_counter() - start
                timed_out = (
                    f"timed out after {deadline} s" if scope.cancelled_caught else None
                )
                results[spec.index] = seen.result(spec, send, end, timed_out)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for spec, at in zip(specs, times, strict=True):
                # the deliberate Poisson gaps; the target is absolute, no drift
                await anyio.sleep(max(0.0, at - (time.perf_counter() - start)))
                tg.start_soon(one, spec, start)
        spec_after = await scrape_spec_decode(client, config.url)
    done = tuple(r for r in results if r is not None)
    summary = summarize(done)
    if spec_before is not None and spec_after is not None:
        summary = attrs.evolve(summary, spec_decode=spec_after - spec_before)
    return BenchmarkResult(config, done, summary)


# -- the command ----------------------------------------------------------------


def run_serve(ns: argparse.Namespace) -> int:
    # httpx logs every request at INFO; with root logging at INFO that would
    # bury the table
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = ServeConfig.from_namespace(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if ns.lora_targets is not None and not (ns.server or ns.launch):
        print("error: --lora-targets names --server/--launch targets", file=sys.stderr)
        return 2
    if ns.server or ns.launch:
        from structllm.bench.serve_compare import run_compare

        return run_compare(ns, config)
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    print(
        f"{config.num_prompts} requests to {config.url}{config.endpoint} at "
        f"{rate} req/s, max concurrency {config.max_concurrency or 'unbounded'}",
        file=sys.stderr,
    )
    if config.model is None:
        try:
            model = anyio.run(discover_model_at, config.url, backend="asyncio")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            print(
                f"error: no model found at {config.url}/v1/models: {exc}",
                file=sys.stderr,
            )
            return 2
        config = attrs.evolve(config, model=model)
    result = anyio.run(run_benchmark, config, backend="asyncio")
    print(result.summary.format(result.config))
    errors: dict[str, int] = {}
    for r in result.requests:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    for message, count in sorted(errors.items(), key=lambda kv: -kv[1])[:5]:
        print(f"{count} x {message}", file=sys.stderr)
    if ns.json:
        Path(ns.json).write_text(json.dumps(result.to_json(), indent=2))
    if ns.plot:
        plot(result, ns.plot)
    return 0 if result.summary.completed else 1
