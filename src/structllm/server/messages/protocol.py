"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's
requests (their content blocks, tools and ``thinking`` in
:mod:`~structllm.server.messages.blocks`; the response, its stream events and
errors in :mod:`~structllm.server.messages.response`).

Requests are validated as Anthropic validates them: a field the Messages API
does not define is a 400 naming it (Anthropic's own "Extra inputs are not
permitted"), and the fields it defines that structllm does not implement are
refused by name with the reason (:data:`MESSAGES_REFUSED`): server tools,
MCP, containers. ``thinking`` is the chat template's ``enable_thinking``
(enabled, it needs a reasoning parser: the serving refuses it without one).
Content blocks are refused or taken as
:mod:`~structllm.server.messages.blocks` says.

The conversation reaches the model as a chat conversation, through the
model's chat template (:meth:`MessagesPrompt.template_messages`): ``system``
becomes a system message, an assistant's ``tool_use`` blocks its
``tool_calls`` and a user's ``tool_result`` blocks ``tool`` messages before
the user's text (Anthropic puts the results first), each ``tools`` entry a
function. A final assistant message with text is Anthropic's prefill: the
answer continues it (chat's ``continue_final_message``) and does not repeat
it. ``tool_choice`` maps onto chat's modes (:mod:`~structllm.server.protocol.tools`):

=====================================  =======================================
``{"type": "auto"}`` (the default)     ``"auto"``: calls found in free text
``{"type": "any"}``                    ``"required"``: a grammar holds the
                                       answer to a list of calls
``{"type": "tool", "name": "f"}``      the named function's arguments,
                                       held to its ``input_schema``
``{"type": "none"}``                   ``"none"``: text; the tools still
                                       reach the template
=====================================  =======================================

``disable_parallel_tool_use`` is chat's ``parallel_tool_calls: false``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Discriminator, Field, PrivateAttr, Tag, model_validator
from pydantic_core import PydanticCustomError

from structllm.errors import InvalidRequestError
from structllm.params import OutputKind, SamplingParams
from structllm.server.messages.blocks import (
    CacheControl,
    MessageParam,
    MessagesTool,
    MessagesToolChoice,
    Metadata,
    TextBlockParam,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceTool,
    ToolUseBlockParam,
    text_or_blocks,
)
from structllm.server.protocol.constraints import rename_field
from structllm.server.protocol.fields import MAX_MESSAGES, Count, Stop, Text, TopK
from structllm.server.protocol.formats import OBJECT_CONFIG, field_error
from structllm.server.protocol.refusals import refuse
from structllm.server.protocol.tools import (
    MAX_TOOLS,
    Check,
    NamedFunction,
    NamedToolChoice,
    Tool,
    tool_constraint,
)
from structllm.structured import StructuredOutputs

__all__ = [
    "MESSAGES_REFUSED",
    "CountTokensRequest",
    "MessagesPrompt",
    "MessagesRequest",
]

#: Anthropic's fields that structllm does not implement: (reason, no-op values)
MESSAGES_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "container": ("containers (code execution) are not supported", ()),
    "mcp_servers": ("MCP servers are not supported", ([],)),
    "context_management": ("context management is not supported", ()),
    "output_config": (
        "output_config is not supported; use /v1/chat/completions with "
        "response_format for structured output",
        ({},),
    ),
    "output_format": (
        "output_format is not supported; use /v1/chat/completions with "
        "response_format for structured output",
        (),
    ),
    "service_tier": ("there is one service tier", ("auto", "standard_only")),
}

# -- requests ---------------------------------------------------------------------


class MessagesPrompt(BaseModel):
    """What a prompt is rendered from: the fields ``/v1/messages`` and
    ``/v1/messages/count_tokens`` share."""

    model_config = OBJECT_CONFIG

    model: Text | None = None
    messages: Annotated[
        list[MessageParam], Field(min_length=1, max_length=MAX_MESSAGES)
    ]
    system: Annotated[
        Annotated[Text, Tag("[text]")]
        | Annotated[
            list[TextBlockParam], Field(max_length=MAX_MESSAGES), Tag("[blocks]")
        ],
        Discriminator(text_or_blocks),
    ] = ""
    tools: Annotated[list[MessagesTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: MessagesToolChoice | None = None
    #: the chat template's ``enable_thinking``; the thinking comes back as
    #: thinking blocks whenever a reasoning parser finds some
    thinking: (
        Annotated[ThinkingEnabled | ThinkingDisabled, Field(discriminator="type")]
        | None
    ) = None
    #: the request-wide caching breakpoint: accepted, no effect
    cache_control: CacheControl | None = None

    #: the forced call's grammar (tool_choice any or tool)
    _constraint: StructuredOutputs | None = PrivateAttr(default=None)
    #: each tool's input_schema, with its field, to compile before admission
    _checks: list[Check] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("body", "the request body must be a JSON object")
        refuse(data, MESSAGES_REFUSED)
        tools = data.get("tools")
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise PydanticCustomError(
                    "refused",
                    "{reason}",
                    {
                        "name": f"tools[{i}].type",
                        "reason": f"server tools ({str(kind)[:40]!r}) are not "
                        "supported; give client tools with an input_schema",
                    },
                )
        # what passed is null or a no-op: nothing to keep
        return {k: v for k, v in data.items() if k not in MESSAGES_REFUSED}

    @model_validator(mode="after")
    def _tool_checks(self) -> MessagesPrompt:
        try:
            self._check_tools()
        except InvalidRequestError as exc:
            raise field_error(exc) from None
        return self

    def _check_tools(self) -> None:
        last = self.messages[-1]
        if self.prefill and any(isinstance(b, ToolUseBlockParam) for b in last.blocks):
            n = len(self.messages) - 1
            raise InvalidRequestError(
                f"messages[{n}].content: a final assistant message is the start "
                "of the answer, so it cannot carry tool_use blocks; send their "
                "tool_result blocks in a user message after it",
                field=f"messages[{n}].content",
            )
        seen: set[str] = set()
        for i, tool in enumerate(self.tools or ()):
            if tool.name in seen:
                raise InvalidRequestError(
                    f"tools[{i}].name: {tool.name!r} names two tools",
                    field=f"tools[{i}].name",
                )
            seen.add(tool.name)
            field = f"tools[{i}].input_schema"
            try:
                self._checks.append((StructuredOutputs(json=tool.input_schema), field))
            except InvalidRequestError as exc:
                raise rename_field(exc, field) from None
        mode = self.tool_mode
        if mode == "none":
            return
        if not self.tools:
            raise InvalidRequestError(
                f"tool_choice: {self.tool_choice_type!r} needs tools, and none are "
                "given",
                field="tool_choice",
            )
        if isinstance(mode, NamedToolChoice) and mode.function.name not in seen:
            raise InvalidRequestError(
                f"tool_choice.name: no tool is named {mode.function.name!r}",
                field="tool_choice.name",
            )
        self._constraint = tool_constraint(
            self.chat_tools(), mode, parallel=self.parallel_tool_use
        )
        if self._constraint is not None:
            self._checks.append((self._constraint, "tool_choice"))

    @property
    def tool_choice_type(self) -> str:
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice.type

    @property
    def tool_mode(self) -> str | NamedToolChoice:
        """Chat's mode: ``"none"``, ``"auto"``, ``"required"`` or the function."""
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceTool):
            return NamedToolChoice(
                type="function", function=NamedFunction(name=choice.name)
            )
        return {"auto": "auto", "any": "required", "none": "none"}[
            self.tool_choice_type
        ]

    @property
    def parallel_tool_use(self) -> bool:
        choice = self.tool_choice
        disabled = getattr(choice, "disable_parallel_tool_use", None)
        return disabled is not True

    @property
    def constraint_checks(self) -> list[Check]:
        """The grammars to compile before admission, each with its field."""
        return list(self._checks)

    def chat_tools(self) -> list[Tool]:
        return [t.chat_tool() for t in self.tools or ()]

    @property
    def system_text(self) -> str:
        if isinstance(self.system, str):
            return self.system
        return "".join(b.text for b in self.system)

    @property
    def prefill(self) -> bool:
        """Whether the answer continues the final message: Anthropic's
        prefill, a final assistant message with text (an empty one is left
        out, and the answer starts a new turn)."""
        last = self.messages[-1]
        if last.role != "assistant":
            return False
        if isinstance(last.content, str):
            return bool(last.content.strip())
        text = "".join(b.text for b in last.blocks if isinstance(b, TextBlockParam))
        return bool(text.strip()) or any(
            isinstance(b, ToolUseBlockParam) for b in last.blocks
        )

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat templates receive it."""
        out: list[dict[str, Any]] = []
        if self.system_text:
            out.append({"role": "system", "content": self.system_text})
        messages = self.messages
        if messages[-1].role == "assistant" and not self.prefill:
            messages = messages[:-1]  # empty: nothing to continue
        for m in messages:
            out += m.template_dicts()
        return out

    def template_options(self) -> dict[str, Any]:
        """The keywords of ``apply_chat_template`` besides the messages: the
        answer starts after a generation prompt, or continues the final
        assistant message (chat's ``continue_final_message``)."""
        tools = self.chat_tools()
        return {
            "add_generation_prompt": not self.prefill,
            "continue_final_message": self.prefill,
            "template_kwargs": self.template_kwargs,
            "tools": [t.template_dict() for t in tools] if tools else None,
        }

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """``thinking`` as the chat template's switch (Qwen3's
        ``enable_thinking``; other templates ignore it)."""
        if self.thinking is None:
            return None
        return {"enable_thinking": self.thinking.type == "enabled"}


class CountTokensRequest(MessagesPrompt):
    """``POST /v1/messages/count_tokens``."""


class MessagesRequest(MessagesPrompt):
    """``POST /v1/messages``."""

    max_tokens: Count
    stop_sequences: Stop = ()
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: TopK | None = None
    metadata: Metadata | None = None
    stream: bool | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        thinking = self.thinking
        if isinstance(thinking, ThinkingEnabled) and (
            thinking.budget_tokens >= self.max_tokens
        ):
            raise PydanticCustomError(
                "field",
                "must be below max_tokens ({max_tokens}): max_tokens bounds the "
                "thinking and the answer together",
                {"name": "thinking.budget_tokens", "max_tokens": self.max_tokens},
            )
        return self

    def to_sampling_params(self) -> SamplingParams:
        kw = {
            n: v
            for n in ("temperature", "top_p", "top_k")
            if (v := getattr(self, n)) is not None
        }
        return SamplingParams(
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            output_kind=OutputKind.DELTA if self.stream else OutputKind.FINAL,
            structured_outputs=self._constraint,
            **kw,
        )
