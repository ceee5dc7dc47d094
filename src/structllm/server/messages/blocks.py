"""The pieces of a ``/v1/messages`` request: its content blocks and messages,
its tools and ``tool_choice``, ``thinking`` and ``metadata``.

Content blocks other than ``text``, ``tool_use``, ``tool_result`` and
``thinking`` (sent back, left out of the prompt) are refused by their path
(``messages[0].content[1].type``): the models read text only.
``cache_control`` is accepted everywhere Anthropic allows it and does
nothing: the prefix cache needs no breakpoints. A message reaches the chat
template as chat messages (:meth:`MessageParam.template_dicts`): an
assistant's ``tool_use`` blocks become its ``tool_calls`` and a user's
``tool_result`` blocks ``tool`` messages before the user's text (Anthropic
puts the results first); each tool becomes a function
(:meth:`MessagesTool.chat_tool`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from structllm.server.protocol.fields import MAX_MESSAGES, Count, NonEmptyText, Text
from structllm.server.protocol.formats import OBJECT_CONFIG, Name, SchemaObject
from structllm.server.protocol.tools import FunctionDefinition, Tool

__all__ = [
    "BlockParam",
    "CacheControl",
    "ContentBlock",
    "MessageParam",
    "MessagesTool",
    "MessagesToolChoice",
    "Metadata",
    "TextBlockParam",
    "ThinkingBlockParam",
    "ThinkingDisabled",
    "ThinkingEnabled",
    "ToolChoiceAny",
    "ToolChoiceAuto",
    "ToolChoiceNone",
    "ToolChoiceTool",
    "ToolResultBlockParam",
    "ToolUseBlockParam",
    "text_or_blocks",
]

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


def text_or_blocks(value: Any) -> str:
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
            Discriminator(text_or_blocks),
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
        Discriminator(text_or_blocks),
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
