"""llama.cpp's native routes, and its aliases of the OpenAI routes.

``POST /completion`` and ``/completions`` (llama.cpp's native completion),
``POST /embedding`` and ``/embeddings`` (its native embeddings; OpenAI's
are ``/v1/embeddings``),
``POST /apply-template`` (messages through the chat template), ``GET /props``, ``GET /slots`` (refused: 501, as llama.cpp without
``--slots``); ``POST /chat/completions`` and ``GET /models``, which
llama.cpp serves without the ``/v1`` prefix, are the OpenAI routes under a
second path. ``/tokenize`` and ``/detokenize`` stay in
:mod:`~structllm.server.tokenize`, which hands llama.cpp's shapes here.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from structllm.server import openapi
from structllm.server.chat.api_router import create_chat_completion
from structllm.server.chat.messages import ChatPrompt
from structllm.server.http.errors import ASCIIJSONResponse, json_error
from structllm.server.llamacpp.protocol import (
    LlamaCompletionRequest,
    LlamaEmbeddingRequest,
)
from structllm.server.llamacpp.serving import LlamaCppServing
from structllm.server.models.api_router import list_models

__all__ = ["router"]

router = APIRouter()


def _serving(request: Request) -> LlamaCppServing:
    serving: LlamaCppServing = request.app.state.llamacpp
    return serving


async def completion(request: Request) -> Response:
    serving = _serving(request)
    return await serving.guarded(request, serving.completion)


for _path in ("/completion", "/completions"):
    router.add_api_route(
        _path,
        completion,
        methods=["POST"],
        openapi_extra=openapi.request_body(LlamaCompletionRequest),
        response_model=None,
        responses=openapi.error_responses(400, 401, 404, 408, 413, 415, 500, 503),
        summary="llama.cpp: complete a prompt (its native fields and answer)",
    )


async def embedding(request: Request) -> Response:
    serving = _serving(request)
    return await serving.guarded(request, serving.embedding)


for _path in ("/embedding", "/embeddings"):
    router.add_api_route(
        _path,
        embedding,
        methods=["POST"],
        openapi_extra=openapi.request_body(LlamaEmbeddingRequest),
        response_model=None,
        responses=openapi.error_responses(400, 401, 404, 408, 413, 415, 500, 503),
        summary="llama.cpp: each prompt's pooled embedding (its native answer)",
    )


@router.post(
    "/apply-template",
    openapi_extra=openapi.request_body(ChatPrompt),
    response_model=None,
    responses=openapi.error_responses(400, 401, 408, 413, 415, 503),
    summary="llama.cpp: chat messages through the chat template, as text",
)
async def apply_template(request: Request) -> Response:
    serving = _serving(request)
    return await serving.guarded(request, serving.apply_template)


@router.get(
    "/props",
    response_model=None,
    responses=openapi.error_responses(401, 503),
    summary="llama.cpp: the server's properties",
)
async def props(request: Request) -> Response:
    serving = _serving(request)
    if serving.slot.llm is None:
        return json_error(
            503,
            "the engine is loading",
            headers={"Retry-After": str(serving.config.retry_after)},
        )
    return ASCIIJSONResponse(serving.props())


@router.post(
    "/props",
    response_model=None,
    responses=openapi.error_responses(400, 401),
    summary="llama.cpp: change the server's properties (refused)",
)
async def set_props(request: Request) -> Response:
    return json_error(
        400, "the server's properties are its flags; they cannot be changed"
    )


@router.get(
    "/slots",
    response_model=None,
    responses=openapi.error_responses(401),
    summary="llama.cpp: per-slot state (refused: 501)",
)
async def slots(request: Request) -> Response:
    return _serving(request).slots()


router.add_api_route(
    "/chat/completions",
    create_chat_completion,
    methods=["POST"],
    response_model=None,
    include_in_schema=False,
)
router.add_api_route(
    "/models",
    list_models,
    methods=["GET"],
    response_model=None,
    include_in_schema=False,
)
