"""The OpenAI request models: the one validation boundary of the server.

Every request body is validated by a typed pydantic model before anything
else looks at it: JSON types (strict: ``"5"`` is not an integer, ``true`` is
not a number), integer and float ranges (64-bit at most anywhere, token ids
below 2**31, counts within sane limits), strings that must be valid Unicode
(a JSON ``"\\ud800"`` escape is a lone surrogate that cannot be encoded),
list lengths (the field types are in :mod:`structllm.server.fields`). A
failure becomes an OpenAI-style 400 whose ``param`` is the path of the field
(``max_tokens``, ``messages[0].content``). The models also give the request
bodies of the OpenAPI schema.

Fields OpenAI or vLLM define but structllm does not implement are refused
with a 400 naming them (:mod:`~structllm.server.refusals`), never accepted
and ignored; unknown fields outside OpenAI's and vLLM's sets are ignored,
as OpenAI-compatible servers do.

The output fields (``response_format``, ``structured_outputs``,
``guided_*``: :mod:`~structllm.server.formats`) and a forced tool call
(:mod:`~structllm.server.tools`; messages with tool calls are
:mod:`~structllm.server.messages`) set at most one
:class:`~structllm.structured.StructuredOutputs`; ``constraint_checks``
lists what the serving compiles before admission (that and each tool's
parameters), so a schema or regex llguidance refuses is a 400 naming the
request's field (``response_format.json_schema.schema``).

``to_sampling_params()`` on each model is the one conversion from an OpenAI
body to :class:`~structllm.params.SamplingParams`.
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
from structllm.params import MAX_COUNT, OutputKind, SamplingParams
from structllm.server.fields import (
    MAX_CHOICES,
    MAX_ID_LIST,
    MAX_N,
    REQUEST_CONFIG,
    CacheSalt,
    Count,
    LogitBias,
    Logprobs,
    NonEmptyText,
    Penalty,
    Prompts,
    Seed,
    Stop,
    Text,
    TokenId,
    TopK,
)
from structllm.server.formats import (
    GUIDED,
    ResponseFormat,
    SchemaObject,
    StructuredOutputsRequest,
    field_error,
    output_constraint,
)
from structllm.server.messages import ChatPrompt, Message
from structllm.server.refusals import (
    CHAT_ONLY,
    CHAT_REFUSED,
    COMPLETION_REFUSED,
    REFUSED,
    refuse,
)
from structllm.server.tools import (
    Check,
    NamedToolChoice,
    ToolChoice,
    check_tools,
    tool_constraint,
)
from structllm.server.validation import validation_error
from structllm.structured import StructuredOutputs

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "Message",
    "SamplingRequest",
    "StreamOptions",
    "validation_error",
]


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG

    include_usage: bool | None = None
    #: usage (so far) in every chunk, not only in the last one
    continuous_usage_stats: bool | None = None


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
    user: Text | None = None
    #: vLLM: requests with different salts never share prefix-cache blocks
    cache_salt: CacheSalt | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: SchemaObject | str | None = None
    guided_regex: NonEmptyText | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyText | None = None

    #: the output constraint, and the request field an error about it names
    _constraint: StructuredOutputs | None = PrivateAttr(default=None)
    _constraint_field: str | None = PrivateAttr(default=None)
    #: what the serving compiles before admission, each with its field
    _checks: list[Check] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("body", "the request body must be a JSON object")
        refuse(data, REFUSED)
        refuse(data, cls.refused_fields)
        return data

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
        guided = {n: v for n in GUIDED if (v := getattr(self, n)) is not None}
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


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    refused_fields = COMPLETION_REFUSED
    prompt: Prompts
    logprobs: Logprobs | None = None

    @model_validator(mode="before")
    @classmethod
    def _chat_only(cls, data: Any) -> Any:
        for name, no_ops in CHAT_ONLY.items():
            value = data.get(name) if isinstance(data, dict) else None
            if value is not None and value not in no_ops:
                raise PydanticCustomError(
                    "refused",
                    "tool calling is only for chat completions",
                    {"name": name},
                )
        return data

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if len(self.prompt) * self.choices > MAX_CHOICES:
            raise PydanticCustomError(
                "prompt",
                f"prompts times n must not exceed {MAX_CHOICES}",
            )
        return self

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        kw = self._sampling_kwargs()
        kw["max_tokens"] = (
            default_max_tokens if self.max_tokens is None else (self.max_tokens)
        )
        kw["logprobs"] = self.logprobs
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            kw["prompt_logprobs"] = self.logprobs  # the echoed prompt's, as vLLM
        return SamplingParams(**kw)


class ChatRequest(SamplingRequest, ChatPrompt):
    """``POST /v1/chat/completions``."""

    refused_fields = CHAT_REFUSED
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None
    #: default: "auto" with tools, "none" without
    tool_choice: ToolChoice | None = None
    #: default true; false: one call at most
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError(
                "top_logprobs", "top_logprobs requires logprobs to be true"
            )
        try:
            self._tool_checks()
        except InvalidRequestError as exc:
            raise field_error(exc) from None
        return self

    def _tool_checks(self) -> None:
        tools = self.tools or []
        self._checks += check_tools(tools)
        choice = self.tool_choice
        if choice is None or choice == "none":
            return
        if not tools:  # as OpenAI and vLLM: "auto" needs tools to choose from
            what = repr(choice)
            if isinstance(choice, NamedToolChoice):
                what = f"the function {choice.function.name!r}"
            raise InvalidRequestError(
                f"tool_choice: {what} needs tools, and none are given",
                field="tool_choice",
            )
        if choice == "auto":
            return
        if self._constraint is not None:
            raise InvalidRequestError(
                f"tool_choice: a forced call cannot be combined with "
                f"{self._constraint_field}",
                field="tool_choice",
            )
        self._constraint = tool_constraint(
            tools, choice, parallel=self.parallel_tool_calls is not False
        )
        self._constraint_field = "tools"
        if self._constraint is not None:
            self._checks.append((self._constraint, "tools"))

    @property
    def tool_mode(self) -> str | NamedToolChoice:
        """``"none"``, ``"auto"``, ``"required"`` or the named function."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def limit_field(self) -> str:
        """The field that set the length limit, for error messages."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        kw = self._sampling_kwargs()
        limit = self.max_completion_tokens or self.max_tokens
        kw["max_tokens"] = default_max_tokens if limit is None else limit
        if self.logprobs:
            kw["logprobs"] = self.top_logprobs or 0
        return SamplingParams(**kw)

    @property
    def echo_text(self) -> str:
        """vLLM's chat ``echo``: the last message, when it is the assistant's."""
        last = self.messages[-1]
        return last.text if self.echo and last.role == "assistant" else ""
