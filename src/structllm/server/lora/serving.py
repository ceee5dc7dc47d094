"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``:
their logic over the server's :class:`~structllm.server.lora.registry.LoRARegistry`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from fastapi.responses import PlainTextResponse, Response

from structllm.server.base import ServingBase
from structllm.server.http.body import validate
from structllm.server.http.errors import json_error
from structllm.server.lora.protocol import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from structllm.server.lora.registry import (
    AdapterNotFoundError,
    LoRAEngine,
    LoRARegistry,
)

__all__ = ["LoRAServing"]


@attrs.define(eq=False)
class LoRAServing(ServingBase):
    """The two routes' logic; ``engine`` gives the engine once it is up
    (``EngineSlot.get``: a 503 while it loads)."""

    registry: LoRARegistry = attrs.field(kw_only=True)
    engine: Callable[[], LoRAEngine] = attrs.field(kw_only=True)

    async def load(self, body: Any, big: bool) -> Response:
        req = validate(LoadLoRAAdapterRequest, body)
        engine = self.engine()
        await self.registry.load(
            engine, req.lora_name, req.lora_path, replace=req.load_inplace
        )
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' added successfully."
        )

    async def unload(self, body: Any, big: bool) -> Response:
        req = validate(UnloadLoRAAdapterRequest, body)
        engine = self.engine()
        await self.registry.unload(engine, req.lora_name, req.lora_int_id)
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' removed successfully."
        )

    def error_response(self, exc: BaseException) -> Response | None:
        if isinstance(exc, AdapterNotFoundError):
            return json_error(404, str(exc), param="lora_name")
        return super().error_response(exc)
