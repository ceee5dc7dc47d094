"""Ollama's API: its request models and their one conversion (``options`` in
:mod:`~structllm.server.ollama.options`, the response models in
:mod:`~structllm.server.ollama.response`).

The requests are validated like the OpenAI ones (strict JSON types, ranges,
errors naming the field by its Ollama path: ``options.temperature``,
``messages[0].images``). ``options`` maps onto :class:`SamplingParams` as
:mod:`~structllm.server.ollama.options` says; an option or a value structllm
cannot honour is a 400 naming it, as are the request fields of
:data:`GENERATE_REFUSED` and :data:`CHAT_REFUSED`. ``format`` is ``"json"``
(a JSON object) or a JSON Schema, held by structured output. ``keep_alive``
is accepted: the model stays loaded for the server's lifetime.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    PlainValidator,
    PrivateAttr,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from structllm.errors import InvalidRequestError
from structllm.params import OutputKind, SamplingParams, is_valid_unicode
from structllm.server.ollama.options import OllamaOptions
from structllm.server.protocol.fields import (
    MAX_CHOICES,
    REQUEST_CONFIG,
    Count,
    Logprobs,
    NonEmptyText,
    Text,
    TokenId,
)
from structllm.server.protocol.formats import SchemaObject, field_error
from structllm.server.protocol.refusals import refuse
from structllm.server.protocol.tools import MAX_TOOLS, Check, Tool, check_tools
from structllm.structured import StructuredOutputs

__all__ = [
    "CHAT_REFUSED",
    "GENERATE_REFUSED",
    "OllamaChatRequest",
    "OllamaEmbedRequest",
    "OllamaEmbeddingsRequest",
    "OllamaGenerateRequest",
    "OllamaMessage",
    "OllamaShowRequest",
]

#: ``/api/generate`` fields structllm refuses -> (reason, no-op values)
GENERATE_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "suffix": ("suffix (insertion) is not supported", ("",)),
    "images": ("images are not supported: text-only models", ([],)),
    "template": ("the model's own chat template is used", ("",)),
    "think": ("reasoning models are not supported", (False,)),
    "width": ("image generation is not supported", ()),
    "height": ("image generation is not supported", ()),
    "steps": ("image generation is not supported", ()),
}

#: ``/api/chat`` fields structllm refuses -> (reason, no-op values)
CHAT_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "think": ("reasoning models are not supported", (False,)),
}

#: a message's fields structllm refuses -> (reason, no-op values)
_MESSAGE_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "images": ("images are not supported: text-only models", ([],)),
    "thinking": ("reasoning models are not supported", ("",)),
}


def _duration(value: Any) -> Any:
    """``keep_alive``: seconds, or a duration string (``"5m"``), or null."""
    ok = value is None or isinstance(value, str | float)
    if not ok and not (isinstance(value, int) and not isinstance(value, bool)):
        raise PydanticCustomError(
            "field", "must be a number of seconds or a duration string", {"name": ""}
        )
    return value


class _OllamaRequest(BaseModel):
    """What ``/api/generate`` and ``/api/chat`` share."""

    model_config = REQUEST_CONFIG

    model: NonEmptyText
    stream: bool | None = None
    #: ``"json"``, a JSON Schema, or ``""`` (none)
    format: Literal["", "json"] | SchemaObject | None = None
    options: OllamaOptions | None = None
    #: accepted: the model stays loaded for the server's lifetime
    keep_alive: Annotated[Any, AfterValidator(_duration)] = None
    #: each generated token's logprob (and ``top_logprobs`` best ones)
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None

    @model_validator(mode="after")
    def _logprobs(self) -> _OllamaRequest:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError(
                "field",
                "top_logprobs requires logprobs to be true",
                {"name": "top_logprobs"},
            )
        return self

    @property
    def streaming(self) -> bool:
        """Ollama streams unless told ``stream: false``."""
        return self.stream is not False

    def constraint(self) -> StructuredOutputs | None:
        if self.format == "json":
            return StructuredOutputs(json_object=True)
        if isinstance(self.format, dict):
            try:
                return StructuredOutputs(json=self.format)
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"format: {exc}", field="format") from None
        return None

    def to_sampling_params(self) -> SamplingParams:
        """The one conversion from this request to the engine's parameters."""
        options = self.options or OllamaOptions()
        return SamplingParams(
            **options.sampling_kwargs(),
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            max_tokens=options.max_tokens,
            output_kind=OutputKind.DELTA if self.streaming else OutputKind.FINAL,
            structured_outputs=self.constraint(),
        )

    @property
    def constraint_checks(self) -> list[Check]:
        c = self.constraint()
        return [] if c is None else [(c, "format")]


class OllamaGenerateRequest(_OllamaRequest):
    """``POST /api/generate``."""

    prompt: Text | None = None
    system: Text | None = None
    #: the prompt as it is, without the chat template
    raw: bool | None = None
    #: the ``context`` a previous answer returned: prepended to the prompt
    context: Annotated[list[TokenId], Field(max_length=1 << 20)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("body", "the request body must be a JSON object")
        refuse(data, GENERATE_REFUSED)
        return data

    @model_validator(mode="after")
    def _raw(self) -> OllamaGenerateRequest:
        if self.raw and self.system:
            raise PydanticCustomError(
                "field",
                "a raw prompt is not templated, so it takes no system message",
                {"name": "system"},
            )
        return self


class _ToolCallFunction(BaseModel):
    model_config = REQUEST_CONFIG

    name: NonEmptyText
    arguments: dict[str, Any]


class _ToolCall(BaseModel):
    model_config = REQUEST_CONFIG

    function: _ToolCallFunction


class OllamaMessage(BaseModel):
    """A message of ``/api/chat``: tool calls' ``arguments`` are objects."""

    model_config = REQUEST_CONFIG

    role: NonEmptyText
    #: null (some clients send it with tool calls) is ""
    content: Text | None = None
    tool_calls: Annotated[list[_ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    #: a tool message: the tool that answered
    tool_name: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse(data, _MESSAGE_REFUSED)
        return data

    def template_dict(self, index: int) -> dict[str, Any]:
        """As chat templates receive it (transformers' shape)."""
        d: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            d["tool_calls"] = [
                {
                    "id": f"call_{index}_{i}",
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": c.function.arguments,
                    },
                }
                for i, c in enumerate(self.tool_calls)
            ]
        if self.tool_name is not None:
            d["name"] = self.tool_name
        return d


class OllamaChatRequest(_OllamaRequest):
    """``POST /api/chat``."""

    messages: Annotated[list[OllamaMessage], Field(max_length=4096)] = Field(
        default_factory=list
    )
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None

    #: each tool's parameters, compiled before admission
    _tool_checks: list[Check] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("body", "the request body must be a JSON object")
        refuse(data, CHAT_REFUSED)
        return data

    @model_validator(mode="after")
    def _tools(self) -> OllamaChatRequest:
        try:
            self._tool_checks = check_tools(self.tools or [])
        except InvalidRequestError as exc:
            raise field_error(exc) from None
        return self

    @property
    def constraint_checks(self) -> list[Check]:
        return super().constraint_checks + self._tool_checks

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict(i) for i, m in enumerate(self.messages)]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.template_dict() for t in self.tools] if self.tools else None


class OllamaShowRequest(BaseModel):
    """``POST /api/show`` (``name`` is the older spelling of ``model``)."""

    model_config = REQUEST_CONFIG

    model: NonEmptyText | None = None
    name: NonEmptyText | None = None
    verbose: bool | None = None


def _embed_input(value: Any) -> tuple[str, ...]:
    """``/api/embed``'s ``input``: a string or a list of strings, none empty."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or len(items) > MAX_CHOICES:
        raise PydanticCustomError(
            "field",
            f"must be a string or a list of 1 to {MAX_CHOICES} strings",
            {"name": ""},
        )
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise PydanticCustomError(
                "input", "input[{i}] must be a non-empty string", {"i": i}
            )
        if not is_valid_unicode(item):
            raise PydanticCustomError(
                "input", "input[{i}] must be valid Unicode", {"i": i}
            )
    return tuple(items)


class _OllamaEmbedBase(BaseModel):
    model_config = REQUEST_CONFIG

    model: NonEmptyText
    #: sampling options have no effect on an embedding; refused ones are
    #: still refused by name
    options: OllamaOptions | None = None
    keep_alive: Annotated[Any, AfterValidator(_duration)] = None


class OllamaEmbedRequest(_OllamaEmbedBase):
    """``POST /api/embed``: normalised embeddings of one or several inputs."""

    input: Annotated[
        tuple[str, ...],
        PlainValidator(_embed_input),
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}},
                ]
            }
        ),
    ]
    #: Ollama cuts inputs longer than the context when true (its default);
    #: structllm never cuts: a longer input is a 400 either way
    truncate: bool | None = None
    dimensions: Count | None = None


class OllamaEmbeddingsRequest(_OllamaEmbedBase):
    """``POST /api/embeddings`` (Ollama's older route): one prompt, unnormalised."""

    prompt: NonEmptyText
