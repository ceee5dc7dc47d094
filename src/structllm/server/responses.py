"""The OpenAI response models: every body the server sends is one of these.

Routes build a model and :func:`dump` turns it into the JSON object sent;
the same models give the response schemas of ``/openapi.json``, so the
document describes what is really sent. Fields listed in a model's
``_omit_unset`` appear only when given (``token_ids`` with
``return_token_ids``, ``usage`` on a chunk); every other field is always
present, ``null`` included, and is marked required in the schema.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any, Literal

from structllm.outputs import FinishReason
from structllm.server.logprobs import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from structllm.server.response_base import Body as _Body
from structllm.server.response_base import dump

__all__ = [
    "ChatChoice",
    "ChatCompletionResponse",
    "ChatCompletionStreamResponse",
    "ChatDelta",
    "ChatFinishReason",
    "ChatLogprobs",
    "ChatMessage",
    "ChatStreamChoice",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionResponse",
    "CompletionStreamChoice",
    "CompletionStreamResponse",
    "ErrorInfo",
    "ErrorResponse",
    "FunctionCall",
    "FunctionCallDelta",
    "ModelCard",
    "ModelList",
    "PromptLogprob",
    "PromptLogprobs",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
    "chat_logprobs",
    "completion_logprobs",
    "dump",
    "error_body",
    "fingerprint",
    "new_id",
    "now",
    "prompt_logprobs",
    "usage",
]


class ErrorInfo(_Body):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(_Body):
    """Every status other than 200, and the last event of a failed stream."""

    error: ErrorInfo


def error_body(
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=type_, param=param, code=code)
    return dump(ErrorResponse(error=info))


class PromptTokensDetails(_Body):
    #: prompt tokens served from the prefix cache, as OpenAI and vLLM report
    cached_tokens: int


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


# -- completions --------------------------------------------------------------


class CompletionChoice(_Body):
    _omit_unset = frozenset({"prompt_token_ids", "token_ids", "prompt_logprobs"})

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    #: with ``prompt_logprobs`` (vLLM)
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Body):
    """``POST /v1/completions`` without ``stream``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamChoice(_Body):
    _omit_unset = frozenset(
        {"text", "stop_reason", "prompt_token_ids", "token_ids", "prompt_logprobs"}
    )

    index: int
    #: absent from the first chunk unless ``echo`` put the prompt there
    text: str | None = None
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    #: present in the chunk that finishes the choice
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    #: with ``prompt_logprobs``, in the choice's first chunk that has tokens
    prompt_logprobs: PromptLogprobs | None = None


class CompletionStreamResponse(_Body):
    """One ``data:`` event of a streaming ``POST /v1/completions``."""

    _omit_unset = frozenset({"usage"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None


# -- chat ---------------------------------------------------------------------

#: chat adds "tool_calls": the choice ended with calls
ChatFinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]


class FunctionCall(_Body):
    name: str
    #: JSON text of an object
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """The answer: ``content`` is null when the answer is only tool calls."""

    _omit_unset = frozenset({"tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Body):
    _omit_unset = frozenset({"token_ids"})

    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: int | str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Body):
    """``POST /v1/chat/completions`` without ``stream``."""

    _omit_unset = frozenset({"prompt_token_ids", "prompt_logprobs"})

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


class FunctionCallDelta(_Body):
    _omit_unset = frozenset({"name", "arguments"})

    #: in the first delta of a call
    name: str | None = None
    #: a fragment of the arguments' JSON text
    arguments: str | None = None


class ToolCallDelta(_Body):
    """Part of a streamed call: ``id``, ``type`` and ``name`` come first."""

    _omit_unset = frozenset({"id", "type"})

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_Body):
    _omit_unset = frozenset({"role", "content", "tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(_Body):
    _omit_unset = frozenset({"stop_reason", "token_ids"})

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(_Body):
    """One ``data:`` event of a streaming ``POST /v1/chat/completions``."""

    _omit_unset = frozenset({"usage", "prompt_token_ids", "prompt_logprobs"})

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


# -- models -------------------------------------------------------------------


class ModelCard(_Body):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "structllm"
    #: what the model was loaded from: its directory or built-in name (vLLM's)
    root: str
    max_model_len: int


class ModelList(_Body):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def fingerprint(*parts: object) -> str:
    """``system_fingerprint``: changes when the serving configuration does."""
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:12]
    return f"fp_{digest}"
