"""``POST /v1/responses``: its request model (its pieces in
:mod:`~structllm.server.responses.inputs`; the response and its stream events
in :mod:`~structllm.server.responses.objects`).

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

import re
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from structllm.errors import InvalidRequestError
from structllm.server.protocol.fields import (
    MAX_MESSAGES,
    REQUEST_CONFIG,
    Count,
    NonEmptyText,
    Text,
)
from structllm.server.protocol.refusals import refuse
from structllm.server.protocol.tools import MAX_TOOLS
from structllm.server.responses.inputs import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    Metadata,
    ReasoningConfig,
    ResponsesInputMessage,
    ResponsesNamedFunction,
    ResponsesTextConfig,
    ToolChoice,
    content_text,
    text_or_list,
)

__all__ = ["RESPONSES_REFUSED", "ResponsesRequest", "responses_field"]

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


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = REQUEST_CONFIG
    refused_fields: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = RESPONSES_REFUSED

    model: Text | None = None
    input: Annotated[
        Annotated[Text, Tag("[text]")]
        | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES), Tag("[list]")],
        Discriminator(text_or_list),
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
                messages.append({"role": role, "content": content_text(item.content)})
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
                        "content": content_text(item.output),
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
