"""``POST /v1/chat/completions``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from structllm.server import openapi
from structllm.server.chat.protocol import (
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatRequest,
)
from structllm.server.chat.serving import ChatServing

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    openapi_extra=openapi.request_body(ChatRequest),
    response_model=None,
    responses=openapi.responses(ChatCompletionResponse, ChatCompletionStreamResponse),
    summary="Complete a chat",
)
async def create_chat_completion(request: Request) -> Response:
    serving: ChatServing = request.app.state.chat
    return await serving.guarded(request, serving.create)
