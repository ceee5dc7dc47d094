"""``POST /v1/embeddings``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from structllm.server import openapi
from structllm.server.embeddings.protocol import EmbeddingRequest, EmbeddingResponse
from structllm.server.embeddings.serving import EmbeddingServing

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/v1/embeddings",
    openapi_extra=openapi.request_body(EmbeddingRequest),
    response_model=None,
    responses=openapi.responses(EmbeddingResponse),
    summary="Embed inputs: the model's last hidden states, pooled",
)
async def create_embedding(request: Request) -> Response:
    serving: EmbeddingServing = request.app.state.embeddings
    return await serving.guarded(request, serving.create)
