"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (vLLM's
routes, outside ``/v1``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from structllm.errors import EngineLoadingError
from structllm.server import openapi
from structllm.server.llamacpp.serving import LlamaCppServing
from structllm.server.llamacpp.tokens import is_native_tokenize, with_content
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
    native: LlamaCppServing = request.app.state.llamacpp  # llama.cpp's "content"

    async def either(body: Any, big: bool) -> Response:
        if is_native_tokenize(body):
            return await native.tokenize(body, big)
        return await serving.tokenize(body, big)

    return await serving.guarded(request, either)


@router.post(
    "/detokenize",
    openapi_extra=openapi.request_body(DetokenizeRequest),
    response_model=None,
    responses=openapi.responses(DetokenizeResponse),
    summary="Token ids back to text",
)
async def detokenize(request: Request) -> Response:
    serving: TokenizeServing = request.app.state.tokenize
    # llama.cpp sends the same request and reads "content"
    return with_content(await serving.guarded(request, serving.detokenize))


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
