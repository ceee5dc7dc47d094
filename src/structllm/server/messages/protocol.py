"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's request,
its content blocks, and the response, event and error models.

Requests are validated as Anthropic validates them: a field the Messages API
does not define is a 400 naming it (Anthropic's own "Extra inputs are not
permitted"), and the fields it defines that structllm does not implement are
refused by name with the reason (:data:`MESSAGES_REFUSED`): server tools,
MCP, containers. ``thinking`` is the chat template's ``enable_thinking``
(enabled, it needs a reasoning parser: the serving refuses it without one).
Content blocks other than ``text``, ``tool_use``, ``tool_result`` and
``thinking`` (sent back, left out of the prompt) are refused by their path
(``messages[0].content[1].type``): the models read text only.
``cache_control`` is accepted everywhere Anthropic allows it and does
nothing: the prefix cache needs no breakpoints.

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

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    PrivateAttr,
    RootModel,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

from structllm.errors import InvalidRequestError
from structllm.params import OutputKind, SamplingParams
from structllm.server.protocol.bodies import Body
from structllm.server.protocol.constraints import rename_field
from structllm.server.protocol.fields import (
    MAX_MESSAGES,
    Count,
    NonEmptyText,
    Stop,
    Text,
    TopK,
)
from structllm.server.protocol.formats import (
    OBJECT_CONFIG,
    Name,
    SchemaObject,
    field_error,
)
from structllm.server.protocol.refusals import refuse
from structllm.server.protocol.tools import (
    MAX_TOOLS,
    Check,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    Tool,
    tool_constraint,
)
from structllm.structured import StructuredOutputs

__all__ = [
    "MESSAGES_REFUSED",
    "ContentBlock",
    "ContentBlockDeltaEvent",
    "ContentBlockStartEvent",
    "ContentBlockStopEvent",
    "CountTokensRequest",
    "CountTokensResponse",
    "InputJsonDelta",
    "MessageDeltaEvent",
    "MessageParam",
    "MessageResponse",
    "MessageStartEvent",
    "MessageStopEvent",
    "MessageStreamEvent",
    "MessagesError",
    "MessagesErrorResponse",
    "MessagesPrompt",
    "MessagesRequest",
    "MessagesTool",
    "MessagesUsage",
    "PingEvent",
    "SignatureDelta",
    "StopReason",
    "TextBlock",
    "TextDelta",
    "ThinkingBlock",
    "ThinkingDelta",
    "ThinkingEnabled",
    "ToolUseBlock",
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

#: content blocks Anthropic defines that a text-only server cannot take
_BLOCK_REASONS = {
    "image": "image blocks are not supported: the model reads text only",
    "document": "document blocks are not supported: the model reads text only",
    "search_result": "search_result blocks are not supported",
    "redacted_thinking": "redacted_thinking blocks are not supported: their "
    "thinking is encrypted by the server that wrote it",
}
_BLOCKS = ("text", "tool_use", "tool_result", "thinking")


# -- request blocks ---------------------------------------------------------------


def _text_or_blocks(value: Any) -> str:
    # a list is blocks, anything else is held to be text (and said to be not)
    return "[blocks]" if isinstance(value, list) else "[text]"


class CacheControl(BaseModel):
    """A prompt-caching breakpoint: accepted, no effect (the prefix cache
    finds shared prefixes by itself)."""

    model_config = OBJECT_CONFIG

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlockParam(BaseModel):
    model_config = OBJECT_CONFIG

    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    #: accepted when empty: citations come from documents, which are refused
    citations: Annotated[list[Any], Field(max_length=0)] | None = None


class ToolUseBlockParam(BaseModel):
    """A call the assistant made earlier in the conversation."""

    model_config = OBJECT_CONFIG

    type: Literal["tool_use"]
    id: NonEmptyText
    name: NonEmptyText
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ThinkingBlockParam(BaseModel):
    """An assistant's thinking, sent back as it came: accepted and left out
    of the prompt (Anthropic's models do not see earlier turns' thinking
    either), so a tool loop can replay whole assistant messages."""

    model_config = OBJECT_CONFIG

    type: Literal["thinking"]
    thinking: Text
    signature: Text
    cache_control: CacheControl | None = None


class ToolResultBlockParam(BaseModel):
    """The answer to a ``tool_use`` block, in the next user message."""

    model_config = OBJECT_CONFIG

    type: Literal["tool_result"]
    tool_use_id: NonEmptyText
    content: (
        Annotated[
            Annotated[Text, Tag("[text]")]
            | Annotated[list[TextBlockParam], Tag("[blocks]")],
            Discriminator(_text_or_blocks),
        ]
        | None
    ) = None
    #: accepted; the template receives the result's text either way
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(b.text for b in self.content)


def _block_tag(value: Any) -> str | None:
    # tags with brackets are left out of error paths (see validation._path)
    kind = value.get("type") if isinstance(value, dict) else None
    return f"[{kind}]" if kind in _BLOCKS else None


ContentBlock = Annotated[
    Annotated[TextBlockParam, Tag("[text]")]
    | Annotated[ToolUseBlockParam, Tag("[tool_use]")]
    | Annotated[ToolResultBlockParam, Tag("[tool_result]")]
    | Annotated[ThinkingBlockParam, Tag("[thinking]")],
    Discriminator(_block_tag),
]
#: a request's blocks
BlockParam = (
    TextBlockParam | ToolUseBlockParam | ToolResultBlockParam | ThinkingBlockParam
)


class MessageParam(BaseModel):
    model_config = OBJECT_CONFIG

    role: Literal["user", "assistant"]
    content: Annotated[
        Annotated[Text, Tag("[text]")]
        | Annotated[
            list[ContentBlock], Field(max_length=MAX_MESSAGES), Tag("[blocks]")
        ],
        Discriminator(_text_or_blocks),
    ]

    @model_validator(mode="before")
    @classmethod
    def _refuse_blocks(cls, data: Any) -> Any:
        """Blocks of a type this server cannot read, refused by their path."""
        blocks = data.get("content") if isinstance(data, dict) else None
        for i, block in enumerate(blocks if isinstance(blocks, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if not isinstance(kind, str) or kind in _BLOCKS:
                continue
            reason = _BLOCK_REASONS.get(kind, f"{kind!r} blocks are not supported")
            raise PydanticCustomError(
                "refused", "{reason}", {"name": f"content[{i}].type", "reason": reason}
            )
        return data

    @model_validator(mode="after")
    def _roles(self) -> MessageParam:
        for i, block in enumerate(self.blocks):
            if (
                isinstance(block, ToolUseBlockParam | ThinkingBlockParam)
                and self.role != "assistant"
            ):
                raise PydanticCustomError(
                    "field",
                    "only assistant messages carry {kind} blocks",
                    {"name": f"content[{i}]", "kind": block.type},
                )
            if isinstance(block, ToolResultBlockParam) and self.role != "user":
                raise PydanticCustomError(
                    "field",
                    "only user messages carry tool_result blocks",
                    {"name": f"content[{i}]"},
                )
        return self

    @property
    def blocks(self) -> list[BlockParam]:
        return [] if isinstance(self.content, str) else list(self.content)

    def template_dicts(self) -> list[dict[str, Any]]:
        """This message as chat templates receive messages (see the module)."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = "".join(b.text for b in self.blocks if isinstance(b, TextBlockParam))
        if self.role == "assistant":
            d: dict[str, Any] = {"role": "assistant", "content": text}
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": b.input},
                }
                for b in self.blocks
                if isinstance(b, ToolUseBlockParam)
            ]
            if calls:
                d["tool_calls"] = calls
            return [d]
        out: list[dict[str, Any]] = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text}
            for b in self.blocks
            if isinstance(b, ToolResultBlockParam)
        ]
        if text or not out:
            out.append({"role": "user", "content": text})
        return out


# -- tools --------------------------------------------------------------------------


class MessagesTool(BaseModel):
    """A client tool: a function the model may call."""

    model_config = OBJECT_CONFIG

    name: Name
    description: Text | None = None
    #: a JSON Schema for the call's ``input`` object
    input_schema: SchemaObject
    #: "custom" or absent; server tools (web search, ...) are refused
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    #: accepted, true or false: forced calls are always held to the schema
    strict: bool | None = None

    def chat_tool(self) -> Tool:
        """The same tool as chat's function tool."""
        return Tool(
            type="function",
            function=FunctionDefinition(
                name=self.name,
                description=self.description,
                parameters=self.input_schema,
            ),
        )


class ToolChoiceAuto(BaseModel):
    model_config = OBJECT_CONFIG

    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(BaseModel):
    model_config = OBJECT_CONFIG

    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(BaseModel):
    model_config = OBJECT_CONFIG

    type: Literal["tool"]
    name: Name
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(BaseModel):
    model_config = OBJECT_CONFIG

    type: Literal["none"]


MessagesToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
    Discriminator("type"),
]


class Metadata(BaseModel):
    """Accepted, no effect."""

    model_config = OBJECT_CONFIG

    user_id: Text | None = None


class ThinkingEnabled(BaseModel):
    """Extended thinking: served with a reasoning parser (the serving refuses
    it without one). The budget is checked as Anthropic checks it (below
    ``max_tokens``) but does not cut the thinking: ``max_tokens`` bounds the
    thinking and the answer together."""

    model_config = OBJECT_CONFIG

    type: Literal["enabled"]
    budget_tokens: Count


class ThinkingDisabled(BaseModel):
    model_config = OBJECT_CONFIG

    type: Literal["disabled"]


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
        Discriminator(_text_or_blocks),
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


# -- responses ----------------------------------------------------------------------

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
