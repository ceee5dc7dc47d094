"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``
(vLLM's routes; under ``/v1``, so behind ``--api-key``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from structllm.server import openapi
from structllm.server.lora.protocol import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from structllm.server.lora.serving import LoRAServing

__all__ = ["router"]

router = APIRouter()

_TEXT: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Done: vLLM's 'Success: ...' line.",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


@router.post(
    "/v1/load_lora_adapter",
    openapi_extra=openapi.request_body(LoadLoRAAdapterRequest),
    response_model=None,
    responses={**_TEXT, **openapi.error_responses(400, 401, 408, 413, 415, 503)},
    summary="Load a LoRA adapter (PEFT's directory) under a name",
)
async def load_lora_adapter(request: Request) -> Response:
    serving: LoRAServing = request.app.state.lora
    return await serving.guarded(request, serving.load)


@router.post(
    "/v1/unload_lora_adapter",
    openapi_extra=openapi.request_body(UnloadLoRAAdapterRequest),
    response_model=None,
    responses={**_TEXT, **openapi.error_responses(400, 401, 404, 408, 413, 415, 503)},
    summary="Unload a LoRA adapter; requests running with it finish with it",
)
async def unload_lora_adapter(request: Request) -> Response:
    serving: LoRAServing = request.app.state.lora
    return await serving.guarded(request, serving.unload)
