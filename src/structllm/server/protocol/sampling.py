"""The request fields completions and chat share, and their one conversion.

Every request body is validated by a typed pydantic model before anything
else looks at it: JSON types (strict: ``"5"`` is not an integer, ``true`` is
not a number), integer and float ranges (64-bit at most anywhere, token ids
below 2**31, counts within sane limits), strings that must be valid Unicode
(a JSON ``"\\ud800"`` escape is a lone surrogate that cannot be encoded),
list lengths (the field types are in :mod:`structllm.server.protocol.fields`).
A failure becomes an OpenAI-style 400 whose ``param`` is the path of the
field (``max_tokens``, ``messages[0].content``). The models also give the
request bodies of the OpenAPI schema.

Fields OpenAI or vLLM define but structllm does not implement are refused
with a 400 naming them (:mod:`~structllm.server.protocol.refusals`), never
accepted and ignored; unknown fields outside OpenAI's and vLLM's sets are
ignored, as OpenAI-compatible servers do.

llama.cpp's clients send three fields of their own on the OpenAI routes:
``json_schema`` and ``grammar`` are output constraints like the ones below,
and ``n_predict`` is another name for ``max_tokens`` (``-1``: no limit; a
request that sets both to different values is refused naming it).

The output fields (``response_format``, ``structured_outputs``,
``guided_*``, ``json_schema``, ``grammar``:
:mod:`~structllm.server.protocol.formats`) and a forced tool
call (:mod:`~structllm.server.protocol.tools`; messages with tool calls are
:mod:`~structllm.server.chat.messages`) set at most one
:class:`~structllm.structured.StructuredOutputs`; ``constraint_checks``
lists what the serving compiles before admission (that and each tool's
parameters), so a schema or regex llguidance refuses is a 400 naming the
request's field (``response_format.json_schema.schema``).

``to_sampling_params()`` on each API's request model
(:class:`~structllm.server.completions.protocol.CompletionRequest`,
:class:`~structllm.server.chat.protocol.ChatRequest`) is the one conversion
from an OpenAI body to :class:`~structllm.params.SamplingParams`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    model_validator,
)
from pydantic_core import PydanticCustomError

from structllm.errors import InvalidRequestError
from structllm.params import MAX_COUNT, OutputKind
from structllm.server.protocol.fields import (
    MAX_ID_LIST,
    MAX_N,
    REQUEST_CONFIG,
    CacheSalt,
    Count,
    LogitBias,
    Logprobs,
    NonEmptyText,
    Penalty,
    Seed,
    Stop,
    Text,
    TokenId,
    TopK,
)
from structllm.server.protocol.formats import (
    OUTPUT_FIELDS,
    ResponseFormat,
    SchemaObject,
    StructuredOutputsRequest,
    field_error,
    output_constraint,
)
from structllm.server.protocol.refusals import (
    REFUSED,
    refuse,
)
from structllm.server.protocol.tools import (
    Check,
)
from structllm.structured import StructuredOutputs

__all__ = [
    "SamplingRequest",
    "StreamOptions",
]


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG

    include_usage: bool | None = None
    #: usage (so far) in every chunk, not only in the last one
    continuous_usage_stats: bool | None = None


#: the longest ``timeout`` a body may ask for, in seconds (a day)
MAX_TIMEOUT_S = 86400.0


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat."""

    model_config = REQUEST_CONFIG
    #: the endpoint's own refused fields (besides :data:`REFUSED`)
    refused_fields: ClassVar[Mapping[str, tuple[str, tuple[Any, ...]]]] = {}

    model: Text | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    max_tokens: Count | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: Stop = ()
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_ID_LIST)] | None = (
        None
    )
    allowed_token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ID_LIST)] | None
    ) = None
    logit_bias: LogitBias = Field(default_factory=dict)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    echo: bool | None = None
    #: vLLM: each prompt token's logprob and the top-N at its position
    prompt_logprobs: Logprobs | None = None
    #: vLLM: the prompt's and the completion's token ids in the response
    return_token_ids: bool | None = None
    #: vLLM: logprobs name tokens as "token_id:N" instead of their text
    return_tokens_as_token_ids: bool | None = None
    #: vLLM: the per-request ``metrics`` object (with
    #: --enable-per-request-metrics; false leaves it out)
    include_metrics: bool | None = None
    user: Text | None = None
    #: vLLM: requests with different salts never share prefix-cache blocks
    cache_salt: CacheSalt | None = None
    #: vLLM: lower runs first (the engine's scheduling priority)
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] | None = None
    #: seconds the request may take (capped by --request-timeout; the
    #: X-Request-Timeout header sets it too): the engine's deadline for it
    timeout: Annotated[float, Field(gt=0.0, le=MAX_TIMEOUT_S)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: SchemaObject | str | None = None
    guided_regex: NonEmptyText | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyText | None = None
    #: llama.cpp: the output is held to this JSON Schema
    json_schema: SchemaObject | None = None
    #: llama.cpp: the output is held to this GBNF (or Lark) grammar
    grammar: NonEmptyText | None = None
    #: llama.cpp's name for max_tokens; -1: no limit (see ``_n_predict``)
    n_predict: Annotated[int, Field(ge=-1, le=MAX_COUNT)] | None = None

    #: the output constraint, and the request field an error about it names
    _constraint: StructuredOutputs | None = PrivateAttr(default=None)
    _constraint_field: str | None = PrivateAttr(default=None)
    #: what the serving compiles before admission, each with its field
    _checks: list[Check] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _intake(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("body", "the request body must be a JSON object")
        refuse(data, REFUSED)
        refuse(data, cls.refused_fields)
        return _n_predict(data)

    @model_validator(mode="after")
    def _cross_checks(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "stream_options", "stream_options is only allowed when stream is true"
            )
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise PydanticCustomError(
                "best_of", "best_of other than n is not supported"
            )
        guided = {n: v for n in OUTPUT_FIELDS if (v := getattr(self, n)) is not None}
        try:
            self._constraint, self._constraint_field = output_constraint(
                self.response_format, self.structured_outputs, guided
            )
        except InvalidRequestError as exc:
            raise field_error(exc) from None
        if self._constraint is not None and self._constraint_field is not None:
            self._checks.append((self._constraint, self._constraint_field))
        return self

    @property
    def constraint_checks(self) -> list[Check]:
        """The constraints to compile before admission, each with its field."""
        return list(self._checks)

    @property
    def constraint_field(self) -> str | None:
        """The field that set the output constraint (for the engine's errors)."""
        return self._constraint_field

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        o = self.stream_options
        return bool(o and o.include_usage and o.continuous_usage_stats)

    @property
    def limit_field(self) -> str:
        """The field that set the length limit, for error messages."""
        return "n_predict" if self.n_predict and self.n_predict > 0 else "max_tokens"

    @property
    def choices(self) -> int:
        return self.n or 1

    def _sampling_kwargs(self) -> dict[str, Any]:
        names = (
            "min_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop_token_ids",
            "allowed_token_ids",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "prompt_logprobs",
        )
        kw = {n: v for n in names if (v := getattr(self, n)) is not None}
        kw["stop"] = self.stop
        kw["logit_bias"] = self.logit_bias
        kw["output_kind"] = OutputKind.DELTA if self.stream else OutputKind.FINAL
        kw["structured_outputs"] = self._constraint
        return kw


def _n_predict(data: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's ``n_predict`` as ``max_tokens``, which the rest reads.

    A value of the wrong type or range is left to the field's own validator,
    which names ``n_predict``. With ``max_tokens`` or ``max_completion_tokens``
    also set, the two must agree (llama.cpp would silently take
    ``n_predict``).
    """
    n = data.get("n_predict")
    if not isinstance(n, int) or isinstance(n, bool) or not -1 <= n <= MAX_COUNT:
        return data
    if n == 0:
        raise PydanticCustomError(
            "field",
            "must be -1 (no limit) or at least 1",
            {"name": "n_predict"},
        )
    limits = ("max_tokens", "max_completion_tokens")
    for name in limits:
        if (given := data.get(name)) is not None and given != n:
            raise PydanticCustomError(
                "field",
                "is llama.cpp's name for {limit}, which is set to another value",
                {"name": "n_predict", "limit": name},
            )
    if n == -1 or any(data.get(name) is not None for name in limits):
        return data
    return {**data, "max_tokens": n}
