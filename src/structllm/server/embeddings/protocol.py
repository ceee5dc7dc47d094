"""Request and response models of ``POST /v1/embeddings``, OpenAI's shapes.

:class:`EmbeddingRequest` takes ``input`` as a string, a list of strings, a
list of token ids or a list of lists of them; ``encoding_format``
(``"float"`` or ``"base64"``: the little-endian float32 bytes, as OpenAI
sends them and its client decodes); ``dimensions`` (Matryoshka: the first
values, normalised after when normalising); and vLLM's ``normalize`` (or
``use_activation``), ``add_special_tokens``, ``priority`` and
``cache_salt``, with structllm's ``pooling``
(``"last"`` or ``"mean"``; default: the checkpoint's). Fields vLLM defines
and structllm does not implement are refused by name
(:data:`EMBEDDING_REFUSED`). The response is an :class:`EmbeddingResponse`:
``data`` in input order, ``usage`` with ``prompt_tokens`` and
``total_tokens`` (and vLLM's ``completion_tokens``, 0).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from structllm.server.protocol.bodies import Body
from structllm.server.protocol.fields import (
    REQUEST_CONFIG,
    CacheSalt,
    Count,
    Prompts,
    Text,
)

__all__ = [
    "EMBEDDING_REFUSED",
    "EmbeddingData",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EmbeddingUsage",
]

#: vLLM's embedding fields that structllm refuses (present and not null)
EMBEDDING_REFUSED = {
    "messages": "chat messages are not embedded; send the text as input",
    "truncate_prompt_tokens": "prompts are not truncated; shorten the input",
    "embed_dtype": "embeddings are float32 only",
    "endianness": "base64 embeddings are little-endian only",
    "mm_processor_kwargs": "multimodal input is not supported",
    "chat_template": "custom chat templates are not supported",
    "request_id": "send the request id as the X-Request-Id header",
}


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``."""

    model_config = REQUEST_CONFIG

    model: Text | None = None
    input: Prompts
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    #: OpenAI's end-user id: accepted, unused
    user: Text | None = None
    #: unit length; None: as the checkpoint's sentence-transformers config says
    normalize: bool | None = None
    #: vLLM's newer name for ``normalize`` (an embedding's "activation")
    use_activation: bool | None = None
    #: "last" token or "mean" of every position; None: the checkpoint's own
    pooling: Literal["last", "mean"] | None = None
    #: BOS and the like, as a completion request adds them
    add_special_tokens: bool = True
    priority: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)
    #: requests with different salts never share prefix-cache blocks
    cache_salt: CacheSalt | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("body", "the request body must be a JSON object")
        for name, reason in EMBEDDING_REFUSED.items():
            if data.get(name) is not None:
                raise PydanticCustomError(
                    "refused", "{reason}", {"name": name, "reason": reason}
                )
        return data

    @model_validator(mode="after")
    def _activation(self) -> EmbeddingRequest:
        both = (self.normalize, self.use_activation)
        if None not in both and both[0] != both[1]:
            raise PydanticCustomError(
                "field",
                "normalize and use_activation (its other name) disagree",
                {"name": "use_activation"},
            )
        return self

    @property
    def normalized(self) -> bool | None:
        """Whether to normalise; None: the checkpoint's default."""
        return self.normalize if self.normalize is not None else self.use_activation


class EmbeddingData(Body):
    object: Literal["embedding"] = "embedding"
    index: int
    #: the floats, or base64 of their little-endian float32 bytes
    embedding: list[float] | str


class EmbeddingUsage(Body):
    prompt_tokens: int
    total_tokens: int
    #: always 0 (vLLM sends it; OpenAI's usage has the other two only)
    completion_tokens: int = 0


class EmbeddingResponse(Body):
    _omit_unset: ClassVar[frozenset[str]] = frozenset()

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
