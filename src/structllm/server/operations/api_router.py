"""``GET /health``, ``GET /metrics``, ``GET /version``: for load balancers,
Prometheus and operators."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

import structllm
from structllm.server import openapi
from structllm.server.http.drain import Drain
from structllm.server.http.errors import ASCIIJSONResponse
from structllm.server.metrics import CONTENT_TYPE
from structllm.server.operations.protocol import HealthResponse, VersionResponse
from structllm.server.protocol.bodies import dump
from structllm.server.serving import Serving

__all__ = ["router"]

router = APIRouter()


@router.get(
    "/health",
    response_model=None,
    responses={
        200: {"model": HealthResponse, "description": "The engine serves."},
        503: {
            "description": "Loading, restarting, draining, dead, or the engine "
            "process has been silent too long (empty body)."
        },
    },
    summary="Health check",
)
async def health(request: Request) -> Response:
    """200 with llama.cpp's ``{"status": "ok"}``, or an empty 503."""
    serving: Serving = request.app.state.serving
    drain: Drain = request.app.state.drain
    llm = serving.slot.llm
    if llm is None or drain.draining or not llm.statistics().healthy:
        return Response(status_code=503)  # loading, shutting down, or failing
    return ASCIIJSONResponse(dump(HealthResponse()))


@router.get(
    "/metrics",
    response_model=None,
    responses={
        200: {
            "description": "Prometheus text exposition.",
            "content": {CONTENT_TYPE: {"schema": {"type": "string"}}},
        },
        **openapi.error_responses(401),
    },
    summary="Prometheus metrics",
)
async def metrics(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    return PlainTextResponse(serving.metrics.render(), media_type=CONTENT_TYPE)


@router.get(
    "/version",
    response_model=None,
    responses=openapi.responses(VersionResponse, errors=()),
    summary="The structllm version",
)
async def version(request: Request) -> Response:
    return ASCIIJSONResponse(dump(VersionResponse(version=structllm.__version__)))
