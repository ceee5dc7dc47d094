"""``POST /v1/responses``: its request model, its response and its stream events.

A request becomes a chat request (:meth:`ResponsesRequest.chat_body`): the
``instructions`` a system message, the ``input`` items chat messages
(``function_call`` items an assistant message's ``tool_calls``,
``function_call_output`` items ``tool`` messages; ``reasoning`` items are
dropped, as chat templates drop past thinking), the flat function tools
chat's ``tools``, ``text.format`` chat's ``response_format`` and
``max_output_tokens`` its ``max_tokens``. An error chat's validation would
raise names the Responses field (:func:`responses_field`).

Fields OpenAI defines and structllm does not implement are refused by name
(:data:`RESPONSES_REFUSED`); ``store: true`` keeps the response in this
server's memory for a later ``previous_response_id``.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Discriminator,
    Field,
    RootModel,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

from structllm.errors import InvalidRequestError
from structllm.server.protocol.bodies import Body
from structllm.server.protocol.fields import (
    MAX_MESSAGES,
    REQUEST_CONFIG,
    Count,
    NonEmptyText,
    Text,
)
from structllm.server.protocol.formats import OBJECT_CONFIG, Name, SchemaObject
from structllm.server.protocol.refusals import refuse
from structllm.server.protocol.tools import MAX_TOOLS

__all__ = [
    "RESPONSES_REFUSED",
    "ContentPart",
    "DeletedResponse",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "IncompleteDetails",
    "InputItem",
    "OutputFunctionCall",
    "OutputItem",
    "OutputMessage",
    "OutputReasoning",
    "OutputText",
    "ReasoningText",
    "ResponseObject",
    "ResponseStreamEvent",
    "ResponseUsage",
    "ResponsesInputMessage",
    "ResponsesRequest",
    "responses_field",
]

#: field -> (reason, no-op values), as :mod:`~structllm.server.protocol.refusals`
RESPONSES_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "background": ("background responses are not supported", (False,)),
    "conversation": ("conversations are not supported; use previous_response_id", ()),
    "include": ("no extra output can be included", ([],)),
    "max_tool_calls": ("max_tool_calls is not supported", ()),
    "prompt": ("prompt templates are not supported", ()),
    "prompt_cache_retention": ("prefix caching needs no retention setting", ()),
    "service_tier": ("there is one service tier", ("auto", "default")),
    "stream_options": ("stream_options is not supported", ()),
    "top_logprobs": ("logprobs are not supported by /v1/responses", (0,)),
    "truncation": ("inputs are never truncated", ("disabled",)),
    "context_management": ("context management is not supported", ()),
    "functions": ("use tools", ([],)),
}


# -- the request --------------------------------------------------------------------


def _content_tag(value: Any) -> str:
    if isinstance(value, dict) and value.get("type") in ("input_text", "output_text"):
        return "[text]"
    return "[other]"


class InputTextPart(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["input_text", "output_text"]
    text: Text


class _OtherPart(BaseModel):
    model_config = REQUEST_CONFIG

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        raise PydanticCustomError(
            "field",
            "content parts other than input_text and output_text are not "
            "supported (text-only models); got {kind!r}",
            {"name": "type", "kind": kind},
        )


ContentPart = Annotated[
    Annotated[InputTextPart, Tag("[text]")] | Annotated[_OtherPart, Tag("[other]")],
    Discriminator(_content_tag),
]


def _text_or_list(value: Any) -> str:
    # tags with brackets are left out of error paths (see protocol._path)
    return "[text]" if isinstance(value, str) else "[list]"


Content = Annotated[
    Annotated[Text, Tag("[text]")]
    | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES), Tag("[list]")],
    Discriminator(_text_or_list),
]


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content if isinstance(p, InputTextPart))


class ResponsesInputMessage(BaseModel):
    """A message: ``{"role", "content"}``, with or without ``type``."""

    model_config = REQUEST_CONFIG

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content


def _json_object(text: str) -> str:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise PydanticCustomError(
            "arguments", "must be a JSON object encoded as a string"
        )
    return text


class FunctionCallItem(BaseModel):
    """A call the model made (sent back in a tool loop)."""

    model_config = REQUEST_CONFIG

    type: Literal["function_call"]
    call_id: NonEmptyText
    name: NonEmptyText
    arguments: Annotated[Text, AfterValidator(_json_object)]


class FunctionCallOutputItem(BaseModel):
    """The answer to a call, by ``call_id``."""

    model_config = REQUEST_CONFIG

    type: Literal["function_call_output"]
    call_id: NonEmptyText
    output: Content


class InputReasoningItem(BaseModel):
    """Thinking from an earlier output: accepted and left out of the prompt."""

    model_config = REQUEST_CONFIG

    type: Literal["reasoning"]


def _item_tag(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else "message"
    known = ("message", "function_call", "function_call_output", "reasoning")
    return f"[{kind}]" if kind in known else "[unknown]"


class _UnknownItem(BaseModel):
    model_config = REQUEST_CONFIG

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        raise PydanticCustomError(
            "field",
            "input items are message, function_call, function_call_output or "
            "reasoning; got {kind!r}",
            {"name": "type", "kind": data.get("type")},
        )


InputItem = Annotated[
    Annotated[ResponsesInputMessage, Tag("[message]")]
    | Annotated[FunctionCallItem, Tag("[function_call]")]
    | Annotated[FunctionCallOutputItem, Tag("[function_call_output]")]
    | Annotated[InputReasoningItem, Tag("[reasoning]")]
    | Annotated[_UnknownItem, Tag("[unknown]")],
    Discriminator(_item_tag),
]


class FunctionTool(BaseModel):
    """A Responses tool: the function's fields at the top (no ``function``)."""

    model_config = OBJECT_CONFIG

    type: Literal["function"]
    name: Name
    description: Text | None = None
    parameters: SchemaObject | None = None
    strict: bool | None = None

    def chat_dict(self) -> dict[str, Any]:
        fn = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": fn}


class ResponsesNamedFunction(BaseModel):
    model_config = OBJECT_CONFIG

    type: Literal["function"]
    name: Name


def _choice_tag(value: Any) -> str:
    return "[function]" if isinstance(value, dict) else "[mode]"


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("[mode]")]
    | Annotated[ResponsesNamedFunction, Tag("[function]")],
    Discriminator(_choice_tag),
]


class ResponsesTextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (flat)."""

    model_config = OBJECT_CONFIG

    type: Literal["text", "json_object", "json_schema"]
    name: Name | None = None
    description: Text | None = None
    schema_: SchemaObject | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _shape(self) -> ResponsesTextFormat:
        if self.type == "json_schema":
            for name in ("name", "schema_"):
                if getattr(self, name) is None:
                    raise PydanticCustomError(
                        "field",
                        "required with type 'json_schema'",
                        {"name": name.rstrip("_")},
                    )
        return self

    def response_format(self) -> dict[str, Any]:
        """Chat's ``response_format`` for the same output."""
        if self.type != "json_schema":
            return {"type": self.type}
        inner: dict[str, Any] = {"name": self.name, "schema": self.schema_}
        if self.strict is not None:
            inner["strict"] = self.strict
        return {"type": "json_schema", "json_schema": inner}


class ResponsesTextConfig(BaseModel):
    model_config = OBJECT_CONFIG

    format: ResponsesTextFormat | None = None
    #: only the one verbosity a model without the setting has
    verbosity: Literal["medium"] | None = None


class ReasoningConfig(BaseModel):
    """``reasoning``: how much a model thinks is its chat template's
    (``enable_thinking``), not adjustable here."""

    model_config = OBJECT_CONFIG

    effort: None = None
    summary: None = None
    generate_summary: None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse(data, _REASONING_REFUSED)
        return data


_REASONING_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "effort": (
        "reasoning effort is not adjustable; chat_template_kwargs.enable_thinking "
        "turns a model's thinking on or off",
        (),
    ),
    "summary": ("reasoning summaries are not made; the thinking itself is sent", ()),
    "generate_summary": ("reasoning summaries are not made", ()),
}


Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[Text, Field(max_length=512)]],
    Field(max_length=16),
]


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = REQUEST_CONFIG
    refused_fields: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = RESPONSES_REFUSED

    model: Text | None = None
    input: Annotated[
        Annotated[Text, Tag("[text]")]
        | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES), Tag("[list]")],
        Discriminator(_text_or_list),
    ]
    #: a system message before the input (not carried to a later response)
    instructions: Text | None = None
    max_output_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    #: keep the response (in memory, bounded) for a later previous_response_id
    store: bool | None = None
    previous_response_id: NonEmptyText | None = None
    metadata: Metadata | None = None
    user: Text | None = None
    #: extra variables for the chat template (``enable_thinking``), as chat's
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("body", "the request body must be a JSON object")
        refuse(data, cls.refused_fields)
        return data

    def input_messages(self) -> list[dict[str, Any]]:
        """The ``input`` as chat messages (``instructions`` left out)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, ResponsesInputMessage):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": _text(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append(
                        {"role": "assistant", "content": None, "tool_calls": [call]}
                    )
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": item.call_id,
                        "content": _text(item.output),
                    }
                )
        return messages

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion request this one is, after ``history``."""
        messages = list(history)
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        messages += self.input_messages()
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tool_choice": self.tool_choice
            if not isinstance(self.tool_choice, ResponsesNamedFunction)
            else {"type": "function", "function": {"name": self.tool_choice.name}},
            "parallel_tool_calls": self.parallel_tool_calls,
            "stream": self.stream,
            "user": self.user,
            "chat_template_kwargs": self.chat_template_kwargs,
        }
        if self.tools:
            body["tools"] = [t.chat_dict() for t in self.tools]
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        return {k: v for k, v in body.items() if v is not None}

    def echo_fields(self) -> dict[str, Any]:
        """The request's settings, as a response repeats them."""
        choice: Any = self.tool_choice
        if isinstance(choice, ResponsesNamedFunction):
            choice = choice.model_dump()
        fmt = (
            self.text.format.model_dump(by_alias=True, exclude_none=True)
            if self.text is not None and self.text.format is not None
            else {"type": "text"}
        )
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tool_choice": choice or ("auto" if self.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "text": {"format": fmt},
            "store": bool(self.store),
        }


#: chat's field paths -> the Responses fields they came from
_FIELDS = [
    (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^max_tokens$"), "max_output_tokens"),
    (re.compile(r"^messages(\[\d+\])?"), "input"),
]


def responses_field(exc: InvalidRequestError) -> InvalidRequestError:
    """``exc``, raised about the chat request, naming the Responses field."""
    own = exc.field
    if not own:
        return exc
    for pattern, repl in _FIELDS:
        field, n = pattern.subn(repl, own, count=1)
        if n:
            message = str(exc).replace(own, field, 1)
            return InvalidRequestError(message, field=field)
    return exc


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
