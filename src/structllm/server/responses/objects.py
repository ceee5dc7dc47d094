"""What ``POST /v1/responses`` answers: the response object, its output items
(messages, reasoning, function calls) and usage, the deleted response, and
the stream's events (each named by its ``type``); built by
:mod:`~structllm.server.responses.output`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, RootModel

from structllm.server.protocol.bodies import Body

__all__ = [
    "ArgumentsDeltaEvent",
    "ArgumentsDoneEvent",
    "ContentPartEvent",
    "DeletedResponse",
    "ErrorEvent",
    "IncompleteDetails",
    "InputTokensDetails",
    "ItemStatus",
    "OutputFunctionCall",
    "OutputItem",
    "OutputItemEvent",
    "OutputMessage",
    "OutputReasoning",
    "OutputText",
    "OutputTokensDetails",
    "ReasoningDeltaEvent",
    "ReasoningDoneEvent",
    "ReasoningText",
    "ResponseEvent",
    "ResponseObject",
    "ResponseStreamEvent",
    "ResponseUsage",
    "TextDeltaEvent",
    "TextDoneEvent",
]

# -- the response --------------------------------------------------------------------


class OutputText(Body):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(Body):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(Body):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputReasoning(Body):
    """The thinking (with a reasoning parser); no summary is made."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


class OutputFunctionCall(Body):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[
    OutputMessage | OutputReasoning | OutputFunctionCall, Discriminator("type")
]


class InputTokensDetails(Body):
    cached_tokens: int


class OutputTokensDetails(Body):
    #: the thinking's tokens (its text tokenised again)
    reasoning_tokens: int


class ResponseUsage(Body):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Body):
    reason: Literal["max_output_tokens"]


class ResponseObject(Body):
    """``POST /v1/responses`` without ``stream``; the ``response`` of events."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: None = None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    tool_choice: Any
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    store: bool
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None


class DeletedResponse(Body):
    """``DELETE /v1/responses/{id}``."""

    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


# -- stream events ---------------------------------------------------------------------


class _Event(Body):
    sequence_number: int


class ResponseEvent(_Event):
    """``response.created``, ``.in_progress`` and ``.completed``."""

    type: Literal["response.created", "response.in_progress", "response.completed"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: Annotated[OutputText | ReasoningText, Discriminator("type")]


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningDeltaEvent(_Event):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = (
        "response.function_call_arguments.done"
    )
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event):
    """The last event of a stream that failed after its 200."""

    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None


class ResponseStreamEvent(
    RootModel[
        ResponseEvent
        | OutputItemEvent
        | ContentPartEvent
        | TextDeltaEvent
        | TextDoneEvent
        | ReasoningDeltaEvent
        | ReasoningDoneEvent
        | ArgumentsDeltaEvent
        | ArgumentsDoneEvent
        | ErrorEvent
    ]
):
    """One ``data:`` event of a streaming ``POST /v1/responses``."""
