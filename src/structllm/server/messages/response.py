"""The response of ``/v1/messages`` and ``/v1/messages/count_tokens``, the
events of a streamed message (:mod:`~structllm.server.messages.streaming`
writes them) and the Anthropic-shaped error body."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import RootModel

from structllm.server.protocol.bodies import Body

__all__ = [
    "ContentBlockDeltaEvent",
    "ContentBlockStartEvent",
    "ContentBlockStopEvent",
    "CountTokensResponse",
    "InputJsonDelta",
    "MessageDelta",
    "MessageDeltaEvent",
    "MessageDeltaUsage",
    "MessageResponse",
    "MessageStartEvent",
    "MessageStopEvent",
    "MessageStreamEvent",
    "MessagesError",
    "MessagesErrorResponse",
    "MessagesUsage",
    "PingEvent",
    "SignatureDelta",
    "StopReason",
    "TextBlock",
    "TextDelta",
    "ThinkingBlock",
    "ThinkingDelta",
    "ToolUseBlock",
]

#: why the answer ended
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlock(Body):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(Body):
    """The thinking a reasoning parser split off, before the answer's blocks."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    #: empty, as llama.cpp sends: a local model's thinking has no signature
    signature: str = ""


class ToolUseBlock(Body):
    type: Literal["tool_use"] = "tool_use"
    #: ``toolu_`` + 24 hex digits
    id: str
    name: str
    input: dict[str, Any]


class MessagesUsage(Body):
    input_tokens: int
    output_tokens: int
    #: prompt tokens served from the prefix cache
    cache_read_input_tokens: int
    #: always 0: nothing is written to a cache on request
    cache_creation_input_tokens: int = 0


class MessageResponse(Body):
    """``POST /v1/messages`` without ``stream``."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: StopReason | None
    #: the stop sequence that ended the answer (``stop_reason`` "stop_sequence")
    stop_sequence: str | None
    usage: MessagesUsage


class CountTokensResponse(Body):
    input_tokens: int


class MessageStartEvent(Body):
    type: Literal["message_start"] = "message_start"
    #: the message with no content yet, stop_reason null
    message: MessageResponse


class ContentBlockStartEvent(Body):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    #: empty: ``thinking`` "", ``text`` "" or ``input`` {}, filled by the deltas
    content_block: ThinkingBlock | TextBlock | ToolUseBlock


class PingEvent(Body):
    type: Literal["ping"] = "ping"


class TextDelta(Body):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(Body):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(Body):
    """The last delta of a thinking block (its signature: empty here)."""

    type: Literal["signature_delta"] = "signature_delta"
    signature: str = ""


class InputJsonDelta(Body):
    type: Literal["input_json_delta"] = "input_json_delta"
    #: a fragment of the call's input, as JSON text
    partial_json: str


class ContentBlockDeltaEvent(Body):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta


class ContentBlockStopEvent(Body):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(Body):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDeltaUsage(Body):
    output_tokens: int


class MessageDeltaEvent(Body):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    #: the output tokens, cumulative
    usage: MessageDeltaUsage


class MessageStopEvent(Body):
    type: Literal["message_stop"] = "message_stop"


class MessagesError(Body):
    #: invalid_request_error, authentication_error, not_found_error,
    #: request_too_large, api_error, overloaded_error, ...
    type: str
    message: str


class MessagesErrorResponse(Body):
    """Every status other than 200 on these routes, and a failed stream's
    ``error`` event."""

    type: Literal["error"] = "error"
    error: MessagesError


class MessageStreamEvent(
    RootModel[
        MessageStartEvent
        | PingEvent
        | ContentBlockStartEvent
        | ContentBlockDeltaEvent
        | ContentBlockStopEvent
        | MessageDeltaEvent
        | MessageStopEvent
        | MessagesErrorResponse
    ]
):
    """One event of a streamed message (for the OpenAPI document)."""
