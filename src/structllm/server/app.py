"""The FastAPI application: the routes, their servings, and what wraps them.

``build_app(slot, config, drain)`` assembles the server from its rooms, one
folder per API, each with its route (``api_router``), its protocol models
(``protocol``) and its serving (``serving``): :mod:`~structllm.server.completions`,
:mod:`~structllm.server.chat`, :mod:`~structllm.server.chat_batch` (vLLM's
``/v1/chat/completions/batch``), :mod:`~structllm.server.messages` (Anthropic's
Messages API), :mod:`~structllm.server.responses` (OpenAI's Responses API),
:mod:`~structllm.server.embeddings`,
:mod:`~structllm.server.tokenize`,
:mod:`~structllm.server.models`, :mod:`~structllm.server.operations`
(``/health``, ``/metrics``, ``/version``), :mod:`~structllm.server.ollama`
(Ollama's ``/api/*``) and :mod:`~structllm.server.llamacpp` (llama.cpp's
native routes and its aliases without ``/v1``). Adding an API is adding a
room.
Beside them, what the rooms share:

- :mod:`~structllm.server.base` (``ServingBase``: the engine slot, the
  disconnect and deadline guard, error mapping, the shared checks and the
  chat render), :mod:`~structllm.server.jobs` (a response's jobs and their
  timings) and :mod:`~structllm.server.serving` (``Serving``: running and
  streaming the jobs, metrics).
- :mod:`~structllm.server.protocol` -- the request and response pieces:
  field types, validation into errors naming the field, refused fields,
  output formats and tool definitions, logprobs, the common bodies (errors,
  usage); they generate ``/openapi.json`` (:mod:`~structllm.server.openapi`).
- :mod:`~structllm.server.http` -- body intake, an OpenAI error body for every
  status (404, 405, 413 and 500 included; Anthropic's on ``/v1/messages``),
  SSE and NDJSON, graceful drain (while
  draining, new ``/v1/`` requests get 503; those still running when the
  grace period ends are cut, a streaming one with a final error event and
  ``[DONE]``), the request id and access log, API keys and CORS, the bound
  on concurrent requests.
- :mod:`~structllm.server.metrics` -- Prometheus, one registry per app.

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
from structllm.server import openapi
from structllm.server.chat import api_router as chat
from structllm.server.chat.serving import ChatServing
from structllm.server.chat_batch import api_router as chat_batch
from structllm.server.chat_batch.serving import ChatBatchServing
from structllm.server.completions import api_router as completions
from structllm.server.completions.serving import CompletionServing
from structllm.server.embeddings import api_router as embeddings
from structllm.server.embeddings.serving import EmbeddingServing
from structllm.server.http.access import RequestContextMiddleware
from structllm.server.http.drain import Drain, DrainMiddleware
from structllm.server.http.errors import error_json, install_handlers
from structllm.server.http.limits import ConcurrencyLimit, LimitState
from structllm.server.http.security import ApiKeyMiddleware, add_cors
from structllm.server.llamacpp import api_router as llamacpp
from structllm.server.llamacpp.serving import LlamaCppServing
from structllm.server.lora import api_router as lora
from structllm.server.lora.registry import LoRARegistry
from structllm.server.lora.serving import LoRAServing
from structllm.server.messages import api_router as messages
from structllm.server.messages.serving import MessagesServing
from structllm.server.metrics import Gauges, Metrics
from structllm.server.models import api_router as models
from structllm.server.ollama import api_router as ollama
from structllm.server.ollama.serving import OllamaServing
from structllm.server.operations import api_router as operations
from structllm.server.protocol.bodies import now
from structllm.server.responses import api_router as responses
from structllm.server.responses.serving import ResponsesServing
from structllm.server.serving import EngineSlot, ServerConfig, Serving
from structllm.server.tokenize import api_router as tokenize
from structllm.server.tokenize.serving import TokenizeServing

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
    app.state.created = now()
    app.state.serving = Serving(slot, config, metrics)
    app.state.completions = CompletionServing(slot, config, metrics)
    app.state.chat = ChatServing(slot, config, metrics)
    app.state.chat_batch = ChatBatchServing(slot, config, metrics)
    app.state.messages = MessagesServing(slot, config, metrics)
    app.state.responses = ResponsesServing(slot, config, metrics)
    app.state.embeddings = EmbeddingServing(slot, config, metrics)
    app.state.tokenize = TokenizeServing(slot, config, metrics)
    app.state.ollama = OllamaServing(slot, config, metrics)
    app.state.llamacpp = LlamaCppServing(slot, config, metrics)
    if slot.loras is None:  # a request's model may name one of them
        slot.loras = LoRARegistry(config.model_name)
    app.state.lora = LoRAServing(
        slot, config, metrics, registry=slot.loras, engine=slot.get
    )
    for api in (
        completions,
        chat,
        chat_batch,
        messages,
        responses,
        embeddings,
        models,
        operations,
        tokenize,
        lora,
        ollama,
        llamacpp,
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
            "spec_decode_num_drafts_total": (
                "Speculative decoding: verification steps of requests with proposals.",
                s.spec_decode_num_drafts,
            ),
            "spec_decode_num_draft_tokens_total": (
                "Speculative decoding: tokens proposed.",
                s.spec_decode_num_draft_tokens,
            ),
            "spec_decode_num_accepted_tokens_total": (
                "Speculative decoding: proposed tokens accepted.",
                s.spec_decode_num_accepted_tokens,
            ),
            "deadline_expired_requests_total": (
                "Requests the engine dropped unfinished when their deadline passed.",
                s.deadline_expired_requests,
            ),
            "deadline_skipped_tokens_total": (
                "Tokens the engine did not run for requests past their deadline "
                "(at most: max_tokens bounds their decode).",
                s.deadline_skipped_tokens,
            ),
        }

    return gauges
