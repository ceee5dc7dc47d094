""":class:`LoRARequest`: which LoRA adapter a request runs with (vLLM's).

``LLM.generate(..., lora_request=LoRARequest("sql", 1, "/adapters/sql"))``
runs the prompts through the adapter in PEFT's directory ``lora_path``
(``adapter_config.json`` + ``adapter_model.safetensors``). The engine
reads it the first time a request names its id and keeps it under that id
(``lora_int_id``) for later requests, so an id names one adapter: a second
request with the same id and another name or path is refused.

Like :class:`~structllm.params.SamplingParams`, every field is checked when
the object is built: a bad value raises
:class:`~structllm.errors.InvalidRequestError` naming the field
(``lora_request.lora_int_id``). This module is in the types layer.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from structllm.errors import InvalidRequestError

__all__ = ["MAX_LORA_ID", "LoRARequest"]

#: ids are positive and below this (they travel as 64-bit integers)
MAX_LORA_ID = 2**63 - 1


def _name(_: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(
            f"lora_request.{attribute.name} must be a non-empty string, got {value!r}",
            field=f"lora_request.{attribute.name}",
        )


def _id(_: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not 1 <= value <= MAX_LORA_ID
    ):
        raise InvalidRequestError(
            f"lora_request.lora_int_id must be an integer from 1 to {MAX_LORA_ID} "
            f"(0 is the base model), got {value!r}",
            field="lora_request.lora_int_id",
        )


def _path(value: object) -> object:
    """A path-like as its string; anything else is left for the validator."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


@attrs.frozen
class LoRARequest:
    """A LoRA adapter by name, id and directory, as vLLM spells it:
    ``LoRARequest(lora_name, lora_int_id, lora_path)``."""

    #: what the server's ``model`` field and ``/v1/models`` call it
    lora_name: str = attrs.field(validator=_name)
    #: the engine's key for it: positive, one adapter per id
    lora_int_id: int = attrs.field(validator=_id)
    #: PEFT's adapter directory (a path-like is taken as its string)
    lora_path: str = attrs.field(converter=_path, validator=_name)

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
