"""The FastAPI application: the routes, their servings, and what wraps them.

``build_app(slot, config, drain)`` assembles the server from its modules:

- :mod:`~structllm.server.routes` -- one module per API (completions, chat,
  models, operations); a route only hands the request to its serving.
- :mod:`~structllm.server.serving` -- the serving base: body reading, the
  disconnect and deadline guard, running and streaming requests, metrics;
  :mod:`~structllm.server.serving_completion` and
  :mod:`~structllm.server.serving_chat` are the two endpoints' logic.
- :mod:`~structllm.server.protocol` (with :mod:`~structllm.server.fields`)
  -- the request models, the one validation boundary, and the conversion to
  ``SamplingParams``; :mod:`~structllm.server.responses` -- the response
  models every body is built from. Both generate ``/openapi.json``
  (:mod:`~structllm.server.openapi`).
- :mod:`~structllm.server.http_errors` -- an OpenAI error body for every
  status, including 404, 405, 413 and 500.
- :mod:`~structllm.server.drain` -- graceful shutdown: while draining, new
  ``/v1/`` requests get 503 (the listener stays open); those still running
  when the grace period ends are cut, a streaming one with a final error
  event and ``[DONE]``.
- :mod:`~structllm.server.metrics` -- Prometheus, one registry per app.
- :mod:`~structllm.server.access` -- the request id (``X-Request-Id``) and
  the access log; :mod:`~structllm.server.security` -- API keys and CORS;
  :mod:`~structllm.server.limits` -- the bound on concurrent requests.

Middleware, outermost first: request context, CORS (only with
``--allowed-origins``), API keys (only with ``--api-key``), the concurrency
limit, drain, then Starlette's own. CORS sits outside the key check so a
browser's preflight is answered without a key; the key check sits outside
the limit so requests without a key never take a slot.

The app needs no socket: tests drive it in process through
``httpx.ASGITransport``, and ``structllm serve`` (:mod:`~structllm.server.run`)
runs it on hypercorn.
"""

from __future__ import annotations

from fastapi import FastAPI

import structllm
from structllm.server import openapi, responses, routes
from structllm.server.access import RequestContextMiddleware
from structllm.server.drain import Drain, DrainMiddleware
from structllm.server.http_errors import error_json, install_handlers
from structllm.server.limits import ConcurrencyLimit, LimitState
from structllm.server.metrics import Gauges, Metrics
from structllm.server.security import ApiKeyMiddleware, add_cors
from structllm.server.serving import EngineSlot, ServerConfig, Serving
from structllm.server.serving_chat import ChatServing
from structllm.server.serving_completion import CompletionServing
from structllm.server.serving_tokenize import TokenizeServing

__all__ = ["Drain", "EngineSlot", "ServerConfig", "build_app", "error_json"]


def build_app(
    slot: EngineSlot, config: ServerConfig, drain: Drain | None = None
) -> FastAPI:
    """The server for the engine in ``slot`` (empty while it loads)."""
    drain = drain or Drain(retry_after=config.retry_after)
    app = FastAPI(
        title="structllm",
        version=structllm.__version__,
        docs_url=None,
        redoc_url=None,
    )
    # add_middleware wraps what is there: innermost first
    app.add_middleware(DrainMiddleware, drain=drain)
    limits = LimitState(
        config.max_concurrent_requests, config.max_concurrent_requests_per_client
    )
    app.add_middleware(ConcurrencyLimit, state=limits, retry_after=config.retry_after)
    if config.api_key:
        app.add_middleware(
            ApiKeyMiddleware,
            keys=config.api_key,
            metrics_require_auth=config.metrics_require_auth,
        )
    add_cors(app, config)
    app.add_middleware(
        RequestContextMiddleware,
        access_log=config.access_log,
        max_log_len=config.max_log_len,
    )
    install_handlers(app)
    app.state.limits = limits
    metrics = Metrics(_gauges(slot))
    app.state.metrics = metrics
    app.state.drain = drain
    app.state.created = responses.now()
    app.state.serving = Serving(slot, config, metrics)
    app.state.completions = CompletionServing(slot, config, metrics)
    app.state.chat = ChatServing(slot, config, metrics)
    app.state.tokenize = TokenizeServing(slot, config, metrics)
    for api in (
        routes.completions,
        routes.chat,
        routes.models,
        routes.operations,
        routes.tokenize,
    ):
        app.include_router(api.router)
    openapi.install(app)
    return app


def _gauges(slot: EngineSlot) -> Gauges:
    def gauges() -> dict[str, tuple[str, float]]:
        if slot.llm is None:
            return {"engine_healthy": ("1 when the engine serves, else 0.", 0.0)}
        s = slot.llm.statistics()
        usage = s.blocks_used / s.num_blocks if s.num_blocks else 0.0
        return {
            "num_requests_running": ("Requests in the running batch.", s.running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", s.waiting),
            "kv_cache_usage_perc": ("Fraction of KV-cache blocks in use.", usage),
            "num_preemptions_total": ("Preemptions since start.", s.total_preemptions),
            "engine_restarts_total": (
                "Engine core process restarts since start.",
                s.restarts,
            ),
            "engine_healthy": ("1 when the engine serves, else 0.", float(s.healthy)),
            "kv_cache_bytes": ("Bytes of the KV cache.", s.kv_cache_bytes),
            "engine_core_peak_rss_bytes": (
                "Peak resident memory of the engine core process(es), in bytes.",
                s.core_peak_rss_bytes,
            ),
            "prefix_cache_queries_total": (
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_cache_queries,
            ),
            "prefix_cache_hits_total": (
                "Prompt tokens found in the prefix cache.",
                s.prefix_cache_hits,
            ),
        }

    return gauges
