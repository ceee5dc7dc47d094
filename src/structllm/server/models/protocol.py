"""``GET /v1/models``: the model card and the list."""

from __future__ import annotations

from typing import Literal

from structllm.server.protocol.bodies import Body

__all__ = [
    "ModelCard",
    "ModelList",
]


class ModelCard(Body):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "structllm"
    #: what the model was loaded from: its directory or built-in name (vLLM's)
    root: str
    #: a LoRA adapter's base model; null on the base model's card (as vLLM)
    parent: str | None = None
    max_model_len: int


class ModelList(Body):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
