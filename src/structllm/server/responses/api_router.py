"""``POST /v1/responses``; ``GET`` and ``DELETE /v1/responses/{id}``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from structllm.server import openapi
from structllm.server.responses.objects import (
    DeletedResponse,
    ResponseObject,
    ResponseStreamEvent,
)
from structllm.server.responses.protocol import ResponsesRequest
from structllm.server.responses.serving import ResponsesServing

__all__ = ["router"]

router = APIRouter()

_RESPONSES = openapi.responses(ResponseObject, ResponseStreamEvent)
_RESPONSES[200]["description"] = (
    "The response; with `stream: true`, server-sent events, each `data:` one "
    "event named by its `type`, from `response.created` to `response.completed` "
    "(or `error`)."
)


@router.post(
    "/v1/responses",
    openapi_extra=openapi.request_body(ResponsesRequest),
    response_model=None,
    responses=_RESPONSES,
    summary="Create a model response (OpenAI's Responses API)",
)
async def create_response(request: Request) -> Response:
    serving: ResponsesServing = request.app.state.responses
    return await serving.guarded(request, serving.create)


@router.get(
    "/v1/responses/{response_id}",
    response_model=None,
    responses=openapi.responses(ResponseObject, errors=(401, 404)),
    summary="A response created with store: true",
)
async def retrieve_response(request: Request, response_id: str) -> Response:
    serving: ResponsesServing = request.app.state.responses
    return serving.retrieve(response_id)


@router.delete(
    "/v1/responses/{response_id}",
    response_model=None,
    responses=openapi.responses(DeletedResponse, errors=(401, 404)),
    summary="Forget a response created with store: true",
)
async def delete_response(request: Request, response_id: str) -> Response:
    serving: ResponsesServing = request.app.state.responses
    return serving.delete(response_id)
