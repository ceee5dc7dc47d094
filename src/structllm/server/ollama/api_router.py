"""Ollama's routes: ``/api/generate``, ``/api/chat``, ``/api/embed``,
``/api/embeddings``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version`` and ``GET /`` (the check Ollama's clients make that the
server is up); the model-management routes
(``pull``, ``push``, ``create``, ``copy``, ``delete``) refused: the server
serves the one model it was started with."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from structllm.server import openapi
from structllm.server.http.errors import ASCIIJSONResponse
from structllm.server.ollama.protocol import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from structllm.server.ollama.response import (
    OllamaChatResponse,
    OllamaEmbeddingsResponse,
    OllamaEmbedResponse,
    OllamaGenerateResponse,
    OllamaProcesses,
    OllamaShowResponse,
    OllamaTags,
    OllamaVersion,
)
from structllm.server.ollama.serving import OllamaServing
from structllm.server.protocol.bodies import dump

__all__ = ["router"]

router = APIRouter()


def _serving(request: Request) -> OllamaServing:
    serving: OllamaServing = request.app.state.ollama
    return serving


def _error(status: int, message: str, serving: OllamaServing) -> Response:
    headers = {"Retry-After": str(serving.config.retry_after)} if status == 503 else {}
    return ASCIIJSONResponse({"error": message}, status_code=status, headers=headers)


@router.post(
    "/api/generate",
    openapi_extra=openapi.request_body(OllamaGenerateRequest),
    response_model=None,
    responses=openapi.responses(OllamaGenerateResponse),
    summary="Ollama: generate from a prompt (NDJSON stream unless stream is false)",
)
async def generate(request: Request) -> Response:
    serving = _serving(request)
    return await serving.guarded(request, serving.generate)


@router.post(
    "/api/chat",
    openapi_extra=openapi.request_body(OllamaChatRequest),
    response_model=None,
    responses=openapi.responses(OllamaChatResponse),
    summary="Ollama: chat (NDJSON stream unless stream is false)",
)
async def chat(request: Request) -> Response:
    serving = _serving(request)
    return await serving.guarded(request, serving.chat)


@router.post(
    "/api/embed",
    openapi_extra=openapi.request_body(OllamaEmbedRequest),
    response_model=None,
    responses=openapi.responses(OllamaEmbedResponse),
    summary="Ollama: normalised embeddings of one input or several",
)
async def embed(request: Request) -> Response:
    serving = _serving(request)
    return await serving.guarded(request, serving.embed)


@router.post(
    "/api/embeddings",
    openapi_extra=openapi.request_body(OllamaEmbeddingsRequest),
    response_model=None,
    responses=openapi.responses(OllamaEmbeddingsResponse),
    summary="Ollama (older route): the embedding of one prompt",
)
async def embeddings(request: Request) -> Response:
    serving = _serving(request)
    return await serving.guarded(request, serving.embeddings)


@router.get(
    "/api/tags",
    response_model=None,
    responses=openapi.responses(OllamaTags, errors=(503,)),
    summary="Ollama: the served model and its LoRA adapters",
)
async def tags(request: Request) -> Response:
    serving = _serving(request)
    if serving.slot.llm is None:
        return _error(503, "the engine is loading", serving)
    return ASCIIJSONResponse(dump(serving.tags()))


@router.get(
    "/api/ps",
    response_model=None,
    responses=openapi.responses(OllamaProcesses, errors=(503,)),
    summary="Ollama: the loaded model and its LoRA adapters",
)
async def processes(request: Request) -> Response:
    serving = _serving(request)
    if serving.slot.llm is None:
        return _error(503, "the engine is loading", serving)
    return ASCIIJSONResponse(dump(serving.processes()))


@router.post(
    "/api/show",
    openapi_extra=openapi.request_body(OllamaShowRequest),
    response_model=None,
    responses=openapi.responses(OllamaShowResponse),
    summary="Ollama: the details of the served model or an adapter",
)
async def show(request: Request) -> Response:
    serving = _serving(request)
    return await serving.guarded(request, serving.show)


@router.api_route(
    "/",
    methods=["GET", "HEAD"],
    response_model=None,
    include_in_schema=False,
)
async def root(request: Request) -> Response:
    """Ollama clients check that the server is up with ``GET /``."""
    return PlainTextResponse("structllm is running")


@router.get(
    "/api/version",
    response_model=None,
    responses=openapi.responses(OllamaVersion, errors=()),
    summary="Ollama: the server's version (structllm's)",
)
async def version(request: Request) -> Response:
    return ASCIIJSONResponse(dump(OllamaServing.version()))


_REFUSED = {
    "/api/pull": "this server serves the model it was started with; it pulls none",
    "/api/push": "this server does not push models",
    "/api/create": "this server serves the model it was started with",
    "/api/copy": "this server serves the model it was started with",
    "/api/delete": "this server serves the model it was started with",
}


def _refused(path: str, message: str) -> None:
    async def refused(request: Request) -> Response:
        return _error(400, f"{path}: {message}", _serving(request))

    method = "DELETE" if path == "/api/delete" else "POST"
    router.add_api_route(
        path,
        refused,
        methods=[method],
        response_model=None,
        responses=openapi.error_responses(400),
        summary=f"Ollama: {path} (refused: {message})",
    )


for _path, _message in _REFUSED.items():
    _refused(_path, _message)
