"""``POST /v1/chat/completions``: its request model and its response models."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    model_validator,
)
from pydantic_core import PydanticCustomError

from structllm.errors import InvalidRequestError
from structllm.params import SamplingParams
from structllm.server.chat.messages import ChatPrompt
from structllm.server.protocol.bodies import Body, PerRequestMetrics, Usage
from structllm.server.protocol.fields import Count, Logprobs
from structllm.server.protocol.formats import field_error
from structllm.server.protocol.logprobs import (
    ChatLogprobs,
    PromptLogprobs,
)
from structllm.server.protocol.refusals import CHAT_REFUSED
from structllm.server.protocol.sampling import SamplingRequest
from structllm.server.protocol.tools import (
    NamedToolChoice,
    ToolChoice,
    check_tools,
    tool_constraint,
)

__all__ = [
    "ChatChoice",
    "ChatCompletionResponse",
    "ChatCompletionStreamResponse",
    "ChatDelta",
    "ChatFinishReason",
    "ChatMessage",
    "ChatRequest",
    "ChatStreamChoice",
    "FunctionCall",
    "FunctionCallDelta",
    "ToolCall",
    "ToolCallDelta",
]

#: chat adds "tool_calls": the choice ended with calls
ChatFinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]


class FunctionCall(Body):
    name: str
    #: JSON text of an object
    arguments: str


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    """The answer: ``content`` is null when the answer is only tool calls.

    ``reasoning_content`` (vLLM's field) is there when a reasoning parser
    is on: the thinking, apart from the answer.
    """

    _omit_unset = frozenset({"tool_calls", "reasoning_content"})

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Body):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: int | str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(Body):
    """``POST /v1/chat/completions`` without ``stream``; vLLM's fields are
    ``null`` when not asked for."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    #: with ``prompt_logprobs``: the prompt's (shared by the choices), as vLLM
    prompt_logprobs: PromptLogprobs | None = None
    #: vLLM's per-request timings (--enable-per-request-metrics, one choice)
    metrics: PerRequestMetrics | None = None


class FunctionCallDelta(Body):
    _omit_unset = frozenset({"name", "arguments"})

    #: in the first delta of a call
    name: str | None = None
    #: a fragment of the arguments' JSON text
    arguments: str | None = None


class ToolCallDelta(Body):
    """Part of a streamed call: ``id``, ``type`` and ``name`` come first."""

    _omit_unset = frozenset({"id", "type"})

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(Body):
    _omit_unset = frozenset({"role", "content", "reasoning_content", "tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    #: a piece of the thinking (with a reasoning parser)
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(Body):
    _omit_unset = frozenset({"stop_reason", "token_ids"})

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(Body):
    """One ``data:`` event of a streaming ``POST /v1/chat/completions``."""

    _omit_unset = frozenset({"usage", "prompt_token_ids", "prompt_logprobs", "metrics"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    #: with ``prompt_logprobs``, in choice 0's first chunk that has tokens
    prompt_logprobs: PromptLogprobs | None = None
    #: in the closing usage chunk, as in a whole response
    metrics: PerRequestMetrics | None = None


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
    #: vLLM's: false drops the thinking (a reasoning parser still splits it off)
    include_reasoning: bool | None = None

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
        if self.max_completion_tokens:
            return "max_completion_tokens"
        return super().limit_field

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
