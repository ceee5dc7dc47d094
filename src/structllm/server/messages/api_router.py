"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from structllm.server import openapi
from structllm.server.messages.protocol import CountTokensRequest, MessagesRequest
from structllm.server.messages.response import (
    CountTokensResponse,
    MessageResponse,
    MessagesErrorResponse,
    MessageStreamEvent,
)
from structllm.server.messages.serving import MessagesServing

__all__ = ["router"]

router = APIRouter()

_STREAM = (
    "The message; with `stream: true`, Anthropic's server-sent events, each "
    "named after its `type` (`message_start`, `ping`, `content_block_start`, "
    "`content_block_delta`, `content_block_stop`, `message_delta`, "
    "`message_stop`; `error` for a failure after the 200)."
)


@router.post(
    "/v1/messages",
    openapi_extra=openapi.request_body(MessagesRequest),
    response_model=None,
    responses=openapi.responses(
        MessageResponse,
        MessageStreamEvent,
        error_model=MessagesErrorResponse,
        description=_STREAM,
    ),
    summary="Create a message (Anthropic's Messages API)",
)
async def create_message(request: Request) -> Response:
    serving: MessagesServing = request.app.state.messages
    return await serving.guarded(request, serving.create)


@router.post(
    "/v1/messages/count_tokens",
    openapi_extra=openapi.request_body(CountTokensRequest),
    response_model=None,
    responses=openapi.responses(CountTokensResponse, error_model=MessagesErrorResponse),
    summary="Count the prompt tokens of a message request",
)
async def count_tokens(request: Request) -> Response:
    serving: MessagesServing = request.app.state.messages
    return await serving.guarded(request, serving.count_tokens)
