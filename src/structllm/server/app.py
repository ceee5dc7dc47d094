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

The app needs no socket: tests drive it in process through
``httpx.ASGITransport``, and ``structllm serve`` (:mod:`~structllm.server.run`)
runs it on hypercorn.
"""

from __future__ import annotations

from fastapi import FastAPI

from structllm.server import openapi, responses, routes
from structllm.server.drain import Drain, DrainMiddleware
from structllm.server.http_errors import error_json, install_handlers
from structllm.server.metrics import Gauges, Metrics
from structllm.server.serving import EngineSlot, ServerConfig, Serving
from structllm.server.serving_chat import ChatServing
from structllm.server.serving_completion import CompletionServing

__all__ = ["Drain", "EngineSlot", "ServerConfig", "build_app", "error_json"]


def build_app(
    slot: EngineSlot, config: ServerConfig, drain: Drain | None = None
) -> FastAPI:
    """The server for the engine in ``slot`` (empty while it loads)."""
    drain = drain or Drain(retry_after=config.retry_after)
    app = FastAPI(title="structllm", docs_url=None, redoc_url=None)
    app.add_middleware(DrainMiddleware, drain=drain)
    install_handlers(app)
    metrics = Metrics(_gauges(slot))
    app.state.metrics = metrics
    app.state.drain = drain
    app.state.created = responses.now()
    app.state.serving = Serving(slot, config, metrics)
    app.state.completions = CompletionServing(slot, config, metrics)
    app.state.chat = ChatServing(slot, config, metrics)
    for api in (routes.completions, routes.chat, routes.models, routes.operations):
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
            "engine_restarts_total": ("Worker restarts since start.", s.restarts),
            "engine_healthy": ("1 when the engine serves, else 0.", float(s.healthy)),
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
