"""The messages of a chat request, tool calls and tool answers included.

An assistant message may carry ``tool_calls`` (the calls the API returned,
``arguments`` a JSON object encoded as a string) and a ``tool`` message
answers one of them by ``tool_call_id``. Chat templates receive each
message as transformers passes it: ``content`` a string (``""`` for none),
each call's ``arguments`` a dict.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from structllm.server.protocol.fields import (
    MAX_MESSAGES,
    REQUEST_CONFIG,
    Content,
    NonEmptyText,
    Text,
)
from structllm.server.protocol.formats import OBJECT_CONFIG
from structllm.server.protocol.tools import MAX_TOOLS, Tool

__all__ = ["ChatPrompt", "FunctionCallParam", "Message", "ToolCallParam"]


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


class FunctionCallParam(BaseModel):
    """A call in an assistant message of the conversation."""

    model_config = OBJECT_CONFIG

    name: NonEmptyText
    #: JSON text of an object, as the API returned it
    arguments: Annotated[Text, AfterValidator(_json_object)]


class ToolCallParam(BaseModel):
    model_config = OBJECT_CONFIG

    id: Text
    type: Literal["function"]
    function: FunctionCallParam

    def template_dict(self) -> dict[str, Any]:
        """As templates expect it: ``arguments`` a dict (transformers' rule)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {
                "name": self.function.name,
                "arguments": json.loads(self.function.arguments),
            },
        }


class Message(BaseModel):
    model_config = REQUEST_CONFIG

    role: NonEmptyText
    content: Content = None
    name: Text | None = None
    #: an assistant message's calls
    tool_calls: Annotated[list[ToolCallParam], Field(max_length=MAX_TOOLS)] | None = (
        None
    )
    #: a tool message's answer is to this call
    tool_call_id: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("function_call") is not None:
            raise PydanticCustomError(
                "refused",
                "function_call is not supported; use tool_calls",
                {"name": "function_call"},
            )
        return data

    @model_validator(mode="after")
    def _roles(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError(
                "field",
                "only assistant messages carry tool_calls",
                {"name": "tool_calls"},
            )
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise PydanticCustomError(
                "field",
                "a tool message needs tool_call_id, and only a tool message has one",
                {"name": "tool_call_id"},
            )
        return self

    @property
    def text(self) -> str:
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates receive it (content always a string)."""
        d: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class ChatPrompt(BaseModel):
    """What a chat prompt is rendered from: the fields chat completions and
    ``/tokenize`` share, and the keywords they give the template."""

    model_config = REQUEST_CONFIG

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    #: written out by the template (as transformers passes them)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    #: default true, or false when the final message is continued
    add_generation_prompt: bool | None = None
    #: render the final message open-ended, for the model to continue it
    continue_final_message: bool = False
    #: extra variables for the chat template (``enable_thinking``, ...)
    chat_template_kwargs: dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]

    def template_options(self) -> dict[str, Any]:
        """The keywords of ``apply_chat_template`` besides the messages
        (``continue_final_message`` with ``add_generation_prompt`` true is a
        400 there)."""
        add = self.add_generation_prompt
        return {
            "add_generation_prompt": (
                not self.continue_final_message if add is None else add
            ),
            "continue_final_message": self.continue_final_message,
            "template_kwargs": self.chat_template_kwargs,
            "tools": [t.template_dict() for t in self.tools] if self.tools else None,
        }
