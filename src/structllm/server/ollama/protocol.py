"""Ollama's API: its request models, their one conversion, its response models.

The requests are validated like the OpenAI ones (strict JSON types, ranges,
errors naming the field by its Ollama path: ``options.temperature``,
``messages[0].images``). ``options`` maps onto :class:`SamplingParams`:

=================================  =========================================
``temperature``, ``top_p``,        the same; ``top_k: 0`` is no top-k
``min_p``, ``top_k``
``seed``                           the same; ``-1`` (Ollama's "random") none
``num_predict``                    ``max_tokens``; ``-1`` / ``-2`` (no limit,
                                   fill the context): up to the context
``stop``                           the same
``repeat_penalty``                 ``repetition_penalty`` (over the prompt
                                   and the output: ``repeat_last_n: -1``)
``presence_penalty``,              the same
``frequency_penalty``
``num_ctx``                        the request must fit in it (400 naming
                                   it when the prompt does not; above the
                                   server's context: 400)
``numa``, ``num_batch``,           accepted, no effect on the output: how
``num_gpu``, ``main_gpu``,         llama.cpp loads and runs the model;
``low_vram``, ``use_mmap``,        structllm's are server flags
``use_mlock``, ``num_thread``,
``f16_kv``, ``penalize_newline``
=================================  =========================================

Any other option, or one of the above with a value structllm cannot honour
(``mirostat`` other than 0, ``typical_p`` / ``tfs_z`` other than 1,
``repeat_last_n`` other than -1 while ``repeat_penalty`` is on, ...), is a
400 naming it, as are the request fields of :data:`GENERATE_REFUSED` and
:data:`CHAT_REFUSED`. ``format`` is ``"json"`` (a JSON object) or a JSON Schema, held by structured output. ``keep_alive`` is
accepted: the model stays loaded for the server's lifetime.
"""

from __future__ import annotations

import json
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
from structllm.server.protocol.bodies import Body
from structllm.server.protocol.fields import (
    MAX_CHOICES,
    REQUEST_CONFIG,
    Count,
    Logprobs,
    NonEmptyText,
    Penalty,
    Seed,
    Stop,
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
    "OPTIONS_REFUSED",
    "OllamaChatMessage",
    "OllamaChatRequest",
    "OllamaChatResponse",
    "OllamaDetails",
    "OllamaEmbedRequest",
    "OllamaEmbedResponse",
    "OllamaEmbeddingsRequest",
    "OllamaEmbeddingsResponse",
    "OllamaGenerateRequest",
    "OllamaGenerateResponse",
    "OllamaLogprob",
    "OllamaMessage",
    "OllamaModel",
    "OllamaOptions",
    "OllamaProcesses",
    "OllamaRunningModel",
    "OllamaShowRequest",
    "OllamaShowResponse",
    "OllamaTags",
    "OllamaTokenLogprob",
    "OllamaVersion",
]

#: options structllm cannot honour -> (reason, no-op values)
OPTIONS_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "mirostat": ("mirostat sampling is not supported", (0,)),
    "typical_p": ("typical sampling is not supported", (1, 1.0)),
    "tfs_z": ("tail-free sampling is not supported", (1, 1.0)),
    "num_keep": ("the context is never shifted, so nothing is kept", ()),
    "vocab_only": ("the server always loads the weights", (False,)),
    "logits_all": ("use logprobs on /v1/completions", (False,)),
    "embedding_only": ("embeddings are served at /api/embed", (False,)),
}

#: options accepted with no effect on the output (llama.cpp's load settings)
_NO_EFFECT = frozenset(
    {
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "use_mmap",
        "use_mlock",
        "num_thread",
        "f16_kv",
        "penalize_newline",
    }
)

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

_Probability = Annotated[float, Field(ge=0.0, le=1.0)]


class OllamaOptions(BaseModel):
    """``options``: Ollama's Modelfile parameters, per request."""

    model_config = REQUEST_CONFIG

    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    min_p: _Probability | None = None
    seed: Seed | None = None
    #: -1: no limit; -2: fill the context (the same here)
    num_predict: Annotated[int, Field(ge=-2, le=2**31 - 1)] | None = None
    stop: Stop = ()
    repeat_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    num_ctx: Count | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("field", "must be an object", {"name": ""})
        known = set(cls.model_fields) | _NO_EFFECT | set(OPTIONS_REFUSED)
        for name in data:
            if name not in known:
                raise PydanticCustomError(
                    "refused",
                    "not an option structllm knows",
                    {"name": name},
                )
        refuse(data, OPTIONS_REFUSED)
        return data

    @model_validator(mode="after")
    def _checks(self) -> OllamaOptions:
        if self.num_predict == 0:
            raise PydanticCustomError(
                "field",
                "must be at least 1, or -1 / -2 for no limit",
                {"name": "num_predict"},
            )
        penalised = self.repeat_penalty not in (None, 1.0)
        if penalised and self.repeat_last_n not in (None, -1):
            raise PydanticCustomError(
                "refused",
                "the repetition penalty covers the whole context (-1)",
                {"name": "repeat_last_n"},
            )
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """The :class:`SamplingParams` keywords these options set."""
        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p", "min_p", "presence_penalty"):
            if (value := getattr(self, name)) is not None:
                kw[name] = value
        if self.frequency_penalty is not None:
            kw["frequency_penalty"] = self.frequency_penalty
        if self.top_k is not None:
            kw["top_k"] = self.top_k  # 0: no top-k, as SamplingParams
        if self.seed is not None and self.seed != -1:
            kw["seed"] = self.seed
        if self.repeat_penalty is not None:
            kw["repetition_penalty"] = self.repeat_penalty
        kw["stop"] = self.stop
        return kw

    @property
    def max_tokens(self) -> int | None:
        n = self.num_predict
        return None if n is None or n < 0 else n


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


# -- responses ---------------------------------------------------------------------


class _Final(Body):
    """The fields of an answer's last object (``done: true``)."""

    _omit_unset = frozenset(
        {
            "done_reason",
            "total_duration",
            "load_duration",
            "prompt_eval_count",
            "prompt_eval_duration",
            "eval_count",
            "eval_duration",
        }
    )

    model: str
    #: RFC 3339, UTC
    created_at: str
    done: bool
    #: "stop", "length", or "load" for a request that only loads the model
    done_reason: str | None = None
    #: nanoseconds
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaTokenLogprob(Body):
    token: str
    logprob: float
    #: the token's UTF-8 bytes
    bytes: list[int]


class OllamaLogprob(OllamaTokenLogprob):
    """A generated token's logprob, with the ``top_logprobs`` best ones."""

    _omit_unset = frozenset({"top_logprobs"})

    top_logprobs: list[OllamaTokenLogprob] | None = None


class OllamaGenerateResponse(_Final):
    """A line of ``/api/generate`` (or its whole answer without streaming)."""

    _omit_unset = _Final._omit_unset | {"context", "logprobs"}

    response: str
    #: the prompt's and the answer's token ids, for the next request
    context: list[int] | None = None
    #: with ``logprobs``: those of this line's tokens
    logprobs: list[OllamaLogprob] | None = None


class _CallFunction(Body):
    name: str
    arguments: dict[str, Any]


class _Call(Body):
    function: _CallFunction


class OllamaChatMessage(Body):
    _omit_unset = frozenset({"tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str
    tool_calls: list[_Call] | None = None


class OllamaChatResponse(_Final):
    """A line of ``/api/chat`` (or its whole answer without streaming)."""

    _omit_unset = _Final._omit_unset | {"logprobs"}

    message: OllamaChatMessage
    #: with ``logprobs``: those of this line's tokens
    logprobs: list[OllamaLogprob] | None = None


def call(name: str, arguments: str) -> _Call:
    """A parsed call (``arguments`` JSON text of an object) in Ollama's shape."""
    return _Call(function=_CallFunction(name=name, arguments=json.loads(arguments)))


class OllamaDetails(Body):
    parent_model: str = ""
    #: "gguf" or "safetensors"
    format: str
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class OllamaModel(Body):
    """An entry of ``/api/tags``."""

    name: str
    model: str
    modified_at: str
    #: bytes of the weights, when they are local files (else 0)
    size: int
    digest: str
    details: OllamaDetails


class OllamaTags(Body):
    """``GET /api/tags``: the one served model."""

    models: list[OllamaModel]


class OllamaRunningModel(OllamaModel):
    """An entry of ``/api/ps``."""

    expires_at: str
    size_vram: int
    context_length: int


class OllamaProcesses(Body):
    """``GET /api/ps``."""

    models: list[OllamaRunningModel]


class OllamaShowResponse(Body):
    """``POST /api/show``."""

    modelfile: str
    parameters: str
    template: str
    details: OllamaDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaVersion(Body):
    """``GET /api/version``."""

    version: str


class OllamaEmbedResponse(Body):
    model: str
    embeddings: list[list[float]]
    #: nanoseconds
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbeddingsResponse(Body):
    embedding: list[float]
