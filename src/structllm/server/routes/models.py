"""``GET /v1/models``: the one served model."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from structllm.server import openapi
from structllm.server.http_errors import ASCIIJSONResponse, json_error
from structllm.server.responses import ModelCard, ModelList, dump
from structllm.server.serving import Serving

__all__ = ["router"]

router = APIRouter()


@router.get(
    "/v1/models",
    response_model=None,
    responses=openapi.responses(ModelList, errors=(503,)),
    summary="List the served model",
)
async def list_models(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    llm = serving.slot.llm
    if llm is None:
        return json_error(
            503,
            "the engine is loading",
            headers={"Retry-After": str(serving.config.retry_after)},
        )
    card = ModelCard(
        id=serving.config.model_name,
        created=request.app.state.created,
        max_model_len=llm.max_model_len,
    )
    return ASCIIJSONResponse(dump(ModelList(data=[card])))
