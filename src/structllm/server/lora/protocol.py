"""The request models of the LoRA routes, vLLM's shapes.

``POST /v1/load_lora_adapter`` takes a :class:`LoadLoRAAdapterRequest`,
``POST /v1/unload_lora_adapter`` an :class:`UnloadLoRAAdapterRequest`;
both answer vLLM's plain-text ``Success: ...`` line, or an OpenAI error.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from structllm.lora_request import MAX_LORA_ID
from structllm.server.protocol.fields import REQUEST_CONFIG, NonEmptyText

__all__ = ["LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest"]


class LoadLoRAAdapterRequest(BaseModel):
    model_config = REQUEST_CONFIG

    #: what requests' ``model`` will call it
    lora_name: NonEmptyText
    #: PEFT's adapter directory, on the server's machine
    lora_path: NonEmptyText
    #: replace an adapter of the same name (requests running with the old
    #: one finish with it)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = REQUEST_CONFIG

    lora_name: NonEmptyText
    #: when given, the adapter's id must be this one
    lora_int_id: Annotated[int, Field(ge=1, le=MAX_LORA_ID)] | None = None
