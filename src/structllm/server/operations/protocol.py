"""``GET /version``'s answer."""

from __future__ import annotations

from structllm.server.protocol.bodies import Body

__all__ = [
    "VersionResponse",
]


class VersionResponse(Body):
    version: str
