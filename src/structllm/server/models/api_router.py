"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one served model."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from structllm.server import openapi
from structllm.server.http.errors import ASCIIJSONResponse, json_error
from structllm.server.models.protocol import ModelCard, ModelList
from structllm.server.protocol.bodies import dump
from structllm.server.serving import Serving

__all__ = ["router"]

router = APIRouter()


def _card(request: Request) -> ModelCard | Response:
    """The served model's card, or the 503 of an engine still loading."""
    serving: Serving = request.app.state.serving
    llm = serving.slot.llm
    if llm is None:
        return json_error(
            503,
            "the engine is loading",
            headers={"Retry-After": str(serving.config.retry_after)},
        )
    return ModelCard(
        id=serving.config.model_name,
        created=request.app.state.created,
        root=llm.engine_config.model,
        max_model_len=llm.max_model_len,
    )


def _adapter_cards(request: Request) -> list[ModelCard]:
    """The LoRA adapters' cards: their base model is their ``parent``."""
    serving: Serving = request.app.state.serving
    llm, loras = serving.slot.llm, serving.slot.loras
    if llm is None or loras is None:
        return []
    return loras.cards(request.app.state.created, llm.max_model_len)


@router.get(
    "/v1/models",
    response_model=None,
    responses=openapi.responses(ModelList, errors=(401, 503)),
    summary="List the served model",
)
async def list_models(request: Request) -> Response:
    card = _card(request)
    if isinstance(card, Response):
        return card
    return ASCIIJSONResponse(dump(ModelList(data=[card, *_adapter_cards(request)])))


@router.get(
    "/v1/models/{model_id:path}",
    response_model=None,
    responses=openapi.responses(ModelCard, errors=(401, 404, 503)),
    summary="The served model, by its id",
)
async def retrieve_model(request: Request, model_id: str) -> Response:
    serving: Serving = request.app.state.serving
    adapters = [c for c in _adapter_cards(request) if c.id == model_id]
    if adapters and serving.slot.llm is not None:
        return ASCIIJSONResponse(dump(adapters[0]))
    if model_id != serving.config.model_name:
        return json_error(
            404,
            f"the model {model_id!r} does not exist; this server serves "
            f"{serving.config.model_name!r}",
            param="model",
        )
    card = _card(request)
    if isinstance(card, Response):
        return card
    return ASCIIJSONResponse(dump(card))
