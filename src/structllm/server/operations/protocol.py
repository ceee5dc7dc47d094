"""``GET /health``'s and ``GET /version``'s answers."""

from __future__ import annotations

from typing import Literal

from structllm.server.protocol.bodies import Body

__all__ = [
    "HealthResponse",
    "VersionResponse",
]


class HealthResponse(Body):
    """llama.cpp's 200 (vLLM's is empty: its clients read the status only)."""

    status: Literal["ok"] = "ok"


class VersionResponse(Body):
    version: str
