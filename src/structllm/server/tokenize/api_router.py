"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (vLLM's
routes, outside ``/v1``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from structllm.errors import EngineLoadingError
from structllm.server import openapi
from structllm.server.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from structllm.server.tokenize.serving import TokenizeServing

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/tokenize",
    openapi_extra=openapi.request_body(TokenizeCompletionRequest, TokenizeChatRequest),
    response_model=None,
    responses=openapi.responses(TokenizeResponse),
    summary="Tokenise a prompt, or chat messages through the chat template",
)
async def tokenize(request: Request) -> Response:
    serving: TokenizeServing = request.app.state.tokenize
    return await serving.guarded(request, serving.tokenize)


@router.post(
    "/detokenize",
    openapi_extra=openapi.request_body(DetokenizeRequest),
    response_model=None,
    responses=openapi.responses(DetokenizeResponse),
    summary="Token ids back to text",
)
async def detokenize(request: Request) -> Response:
    serving: TokenizeServing = request.app.state.tokenize
    return await serving.guarded(request, serving.detokenize)


@router.get(
    "/tokenizer_info",
    response_model=None,
    responses=openapi.responses(TokenizerInfoResponse, errors=(401, 503)),
    summary="The tokenizer's settings and chat template",
)
async def tokenizer_info(request: Request) -> Response:
    serving: TokenizeServing = request.app.state.tokenize
    try:
        return await serving.tokenizer_info()
    except EngineLoadingError as exc:
        response = serving.error_response(exc)
        assert response is not None
        return response
