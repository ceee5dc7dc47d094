"""Tool calls on the response side: a choice's message, or its deltas.

:func:`parser_for` picks the :mod:`~structllm.text.tool_parser` parser the
request's ``tool_choice`` calls for (none for ``"none"``). :func:`message`
builds a whole answer; :class:`StreamedCalls` turns each streamed piece of
text into a content delta and OpenAI tool-call deltas: the first delta of a
call carries its ``index``, ``id`` (``call_`` + 24 random hex digits),
``type`` and ``function.name`` (with ``arguments: ""``), later ones
fragments of ``function.arguments``.

A choice that returned calls and stopped by itself finishes with
``"tool_calls"``. A whole answer whose forced call was cut short
(``max_tokens``) returns its text as ``content``, with no calls, and
finishes with ``"length"``.
"""

from __future__ import annotations

import uuid
from typing import Any

import attrs

from structllm.outputs import CompletionOutput
from structllm.server.chat.protocol import (
    ChatDelta,
    ChatFinishReason,
    ChatMessage,
    ChatRequest,
    FunctionCall,
    ToolCall,
    ToolCallDelta,
)
from structllm.server.protocol.tools import NamedToolChoice
from structllm.text.auto_tool_parser import AutoParser
from structllm.text.tool_parser import (
    ArgumentsDelta,
    CallListParser,
    CallStart,
    ContentDelta,
    NamedCallParser,
    ToolCallParser,
    ToolEvent,
    parse,
)

__all__ = ["StreamedCalls", "message", "new_call_id", "parser_for"]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parser_for(req: ChatRequest) -> ToolCallParser | None:
    """The parser for ``req``'s ``tool_choice``; None when nothing is parsed."""
    mode = req.tool_mode
    if isinstance(mode, NamedToolChoice):
        return NamedCallParser(mode.function.name)
    if mode == "required":
        return CallListParser()
    if mode == "auto" and req.tools:
        names = [t.function.name for t in req.tools]
        return AutoParser(names, parallel=req.parallel_tool_calls is not False)
    return None


def finish_reason(
    reason: ChatFinishReason | None, called: bool
) -> ChatFinishReason | None:
    return "tool_calls" if called and reason == "stop" else reason


def message(
    req: ChatRequest, out: CompletionOutput
) -> tuple[ChatMessage, ChatFinishReason | None]:
    """A whole choice's message and finish reason."""
    text = req.echo_text + out.text
    parser = parser_for(req)
    parsed = parse(parser, out.text) if parser is not None else None
    if parsed is None or not parsed.calls or not parsed.complete:
        return ChatMessage(content=text), out.finish_reason
    calls = [
        ToolCall(
            id=new_call_id(),
            function=FunctionCall(name=c.name, arguments=c.arguments),
        )
        for c in parsed.calls
    ]
    content = req.echo_text + (parsed.content or "")
    message = ChatMessage(content=content or None, tool_calls=calls)
    return message, finish_reason(out.finish_reason, True)


@attrs.define
class StreamedCalls:
    """One streamed choice's parser, and the ids of the calls it started."""

    parser: ToolCallParser
    ids: dict[int, str] = attrs.field(factory=dict)

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def delta(self, text: str, finished: bool) -> ChatDelta:
        """The delta for ``text`` (and the parser's leftovers when finished)."""
        events = self.parser.feed(text)
        if finished:
            events += self.parser.finish()
        return self._delta(events)

    def _delta(self, events: list[ToolEvent]) -> ChatDelta:
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, ContentDelta):
                content.append(e.text)
            elif isinstance(e, CallStart):
                self.ids[e.index] = new_call_id()
                calls.append(
                    {
                        "index": e.index,
                        "id": self.ids[e.index],
                        "type": "function",
                        "function": {"name": e.name, "arguments": ""},
                    }
                )
            elif isinstance(e, ArgumentsDelta) and e.text:
                if calls and calls[-1]["index"] == e.index:
                    calls[-1]["function"]["arguments"] += e.text
                else:
                    calls.append({"index": e.index, "function": {"arguments": e.text}})
        fields: dict[str, Any] = {}
        if content:
            fields["content"] = "".join(content)
        if calls:
            fields["tool_calls"] = [ToolCallDelta.model_validate(c) for c in calls]
        return ChatDelta(**fields)
