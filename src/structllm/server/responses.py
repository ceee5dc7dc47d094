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
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from structllm.outputs import CompletionOutput, FinishReason

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
    "usage",
]


def _required_unless_omitted(schema: dict[str, Any], cls: type[Any]) -> None:
    omit: frozenset[str] = getattr(cls, "_omit_unset", frozenset())
    schema["required"] = [n for n in schema.get("properties", {}) if n not in omit]


class _Body(BaseModel):
    """A response object: fields in ``_omit_unset`` are sent only when given."""

    model_config = ConfigDict(json_schema_extra=_required_unless_omitted)
    _omit_unset: ClassVar[frozenset[str]] = frozenset()

    def model_post_init(self, context: Any, /) -> None:
        # every other field counts as given, so dump(exclude_unset) sends it
        self.__pydantic_fields_set__.update(
            n for n in type(self).model_fields if n not in self._omit_unset
        )


def dump(body: BaseModel) -> dict[str, Any]:
    """The JSON object for ``body`` (Python values: floats stay floats)."""
    return body.model_dump(exclude_unset=True)


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


# -- logprobs -----------------------------------------------------------------


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[ChatTokenLogprob]


def _token_name(token_id: int, piece: str | None, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else (piece or "")


def completion_logprobs(
    out: CompletionOutput, text_offset: int = 0, *, as_ids: bool = False
) -> CompletionLogprobs | None:
    """The completions API's logprobs object for the tokens in ``out``."""
    if out.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for token_id, d in zip(out.token_ids, out.logprobs, strict=True):
        lp = d[token_id]
        piece = lp.decoded_token or ""
        tokens.append(_token_name(token_id, piece, as_ids))
        token_lps.append(lp.logprob)
        tops.append(
            {_token_name(t, v.decoded_token, as_ids): v.logprob for t, v in d.items()}
        )
        offsets.append(offset)
        offset += len(piece)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets
    )


def chat_logprobs(
    out: CompletionOutput, top_n: int, *, as_ids: bool = False
) -> ChatLogprobs | None:
    """The chat API's logprobs object: each token with its ``top_n`` best."""
    if out.logprobs is None:
        return None
    content = []
    for token_id, d in zip(out.token_ids, out.logprobs, strict=True):
        lp = d[token_id]
        name = _token_name(token_id, lp.decoded_token, as_ids)
        ranked = sorted(
            d.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30
        )
        tops = []
        for t, v in ranked[:top_n]:
            top = _token_name(t, v.decoded_token, as_ids)
            tops.append(
                TopLogprob(token=top, logprob=v.logprob, bytes=list(top.encode()))
            )
        content.append(
            ChatTokenLogprob(
                token=name,
                logprob=lp.logprob,
                bytes=list(name.encode()),
                top_logprobs=tops,
            )
        )
    return ChatLogprobs(content=content)


# -- completions --------------------------------------------------------------


class CompletionChoice(_Body):
    _omit_unset = frozenset({"prompt_token_ids", "token_ids"})

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


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
    _omit_unset = frozenset({"text", "stop_reason", "prompt_token_ids", "token_ids"})

    index: int
    #: absent from the first chunk unless ``echo`` put the prompt there
    text: str | None = None
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    #: present in the chunk that finishes the choice
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


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

    _omit_unset = frozenset({"prompt_token_ids"})

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


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

    _omit_unset = frozenset({"usage", "prompt_token_ids"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


# -- models -------------------------------------------------------------------


class ModelCard(_Body):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "structllm"
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
