"""``POST /v1/completions``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from structllm.server import openapi
from structllm.server.completions.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from structllm.server.completions.serving import CompletionServing

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/v1/completions",
    openapi_extra=openapi.request_body(CompletionRequest),
    response_model=None,
    responses=openapi.responses(CompletionResponse, CompletionStreamResponse),
    summary="Complete prompts",
)
async def create_completion(request: Request) -> Response:
    serving: CompletionServing = request.app.state.completions
    return await serving.guarded(request, serving.create)
