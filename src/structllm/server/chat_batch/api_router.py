"""``POST /v1/chat/completions/batch`` (vLLM's route)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from structllm.server import openapi
from structllm.server.chat.protocol import ChatCompletionResponse
from structllm.server.chat_batch.protocol import BatchChatRequest
from structllm.server.chat_batch.serving import ChatBatchServing

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/v1/chat/completions/batch",
    openapi_extra=openapi.request_body(BatchChatRequest),
    response_model=None,
    responses=openapi.responses(ChatCompletionResponse),
    summary="Complete several conversations, one choice each",
)
async def create_batch_chat_completion(request: Request) -> Response:
    serving: ChatBatchServing = request.app.state.chat_batch
    return await serving.guarded(request, serving.create)
