"""The pieces of a ``POST /v1/responses`` request: its ``input`` items and
their content parts, its function tools and ``tool_choice``, ``text.format``
and ``reasoning`` (:class:`~structllm.server.responses.protocol.ResponsesRequest`
turns them into a chat request).

Items and parts of a type structllm does not take are refused by their type;
``reasoning`` items are accepted and dropped, as chat templates drop past
thinking.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Discriminator,
    Field,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

from structllm.server.protocol.fields import (
    MAX_MESSAGES,
    REQUEST_CONFIG,
    NonEmptyText,
    Text,
)
from structllm.server.protocol.formats import OBJECT_CONFIG, Name, SchemaObject
from structllm.server.protocol.refusals import refuse

__all__ = [
    "Content",
    "ContentPart",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "InputItem",
    "InputReasoningItem",
    "InputTextPart",
    "Metadata",
    "ReasoningConfig",
    "ResponsesInputMessage",
    "ResponsesNamedFunction",
    "ResponsesTextConfig",
    "ResponsesTextFormat",
    "ToolChoice",
    "content_text",
    "text_or_list",
]

# -- content parts --------------------------------------------------------------------


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


def text_or_list(value: Any) -> str:
    # tags with brackets are left out of error paths (see protocol._path)
    return "[text]" if isinstance(value, str) else "[list]"


Content = Annotated[
    Annotated[Text, Tag("[text]")]
    | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES), Tag("[list]")],
    Discriminator(text_or_list),
]


def content_text(content: str | list[Any]) -> str:
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
