"""Tool calls on the response side: a choice's message, or its deltas.

:func:`call_parser` picks the :mod:`~structllm.text.tool_parser` parser a
``tool_choice`` calls for (none for ``"none"``; :func:`parser_for`, a chat
request's). :func:`message`
builds a whole answer; :class:`StreamedCalls` turns each streamed piece of
text into a content delta and OpenAI tool-call deltas: the first delta of a
call carries its ``index``, ``id`` (``call_`` + 24 random hex digits),
``type`` and ``function.name`` (with ``arguments: ""``), later ones
fragments of ``function.arguments``.

A choice that returned calls and stopped by itself finishes with
``"tool_calls"``. A whole answer whose forced call was cut short
(``max_tokens``) returns its text as ``content``, with no calls, and
finishes with ``"length"``.

With a reasoning parser (:mod:`structllm.text.reasoning`), the thinking is
split off first and calls are looked for in the answer alone
(:class:`AnswerParser`, which the Responses API shares).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
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
from structllm.text.reasoning import ReasoningParser, split
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

__all__ = [
    "AnswerParser",
    "StreamedCalls",
    "call_parser",
    "message",
    "new_call_id",
    "parser_for",
]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_parser(
    mode: str | NamedToolChoice, names: Sequence[str], *, parallel: bool
) -> ToolCallParser | None:
    """The parser for a ``tool_choice`` mode (``"none"``, ``"auto"``,
    ``"required"`` or a named function) over the tools ``names``; None when
    nothing is parsed. Every API that takes tools finds its calls with it."""
    if isinstance(mode, NamedToolChoice):
        return NamedCallParser(mode.function.name)
    if mode == "required":
        return CallListParser()
    if mode == "auto" and names:
        return AutoParser(list(names), parallel=parallel)
    return None


def parser_for(req: ChatRequest) -> ToolCallParser | None:
    """The parser for ``req``'s ``tool_choice``; None when nothing is parsed."""
    names = [t.function.name for t in req.tools or ()]
    return call_parser(
        req.tool_mode, names, parallel=req.parallel_tool_calls is not False
    )


def finish_reason(
    reason: ChatFinishReason | None, called: bool
) -> ChatFinishReason | None:
    return "tool_calls" if called and reason == "stop" else reason


@attrs.define
class AnswerParser:
    """One choice's text as it streams: the thinking split off, then the
    calls (``calls``, when tools are parsed) found in the answer."""

    calls: ToolCallParser | None
    reasoning: ReasoningParser | None = None

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolEvent]]:
        """The reasoning and the answer's events in ``text`` (and the
        parsers' leftovers when ``finished``)."""
        thought = ""
        if self.reasoning is not None:
            d = self.reasoning.feed(text)
            if finished:
                d += self.reasoning.finish()
            thought, text = d.reasoning, d.content
        if self.calls is None:
            return thought, [ContentDelta(text)] if text else []
        events = self.calls.feed(text)
        if finished:
            events += self.calls.finish()
        return thought, events


def message(
    req: ChatRequest, out: CompletionOutput, reasoning: ReasoningParser | None = None
) -> tuple[ChatMessage, ChatFinishReason | None]:
    """A whole choice's message and finish reason (the thinking split off by
    ``reasoning``, when given)."""
    answer, extra = out.text, dict[str, Any]()
    if reasoning is not None:
        d = split(reasoning, out.text)
        answer = d.content
        if req.include_reasoning is not False:
            extra["reasoning_content"] = d.reasoning or None
    parser = parser_for(req)
    parsed = parse(parser, answer) if parser is not None else None
    if parsed is None or not parsed.calls or not parsed.complete:
        text: str | None = req.echo_text + answer
        if reasoning is not None and not text:
            text = None  # the output was all thinking
        return ChatMessage(content=text, **extra), out.finish_reason
    calls = [
        ToolCall(
            id=new_call_id(),
            function=FunctionCall(name=c.name, arguments=c.arguments),
        )
        for c in parsed.calls
    ]
    content = req.echo_text + (parsed.content or "")
    message = ChatMessage(content=content or None, tool_calls=calls, **extra)
    return message, finish_reason(out.finish_reason, True)


@attrs.define
class StreamedCalls:
    """One streamed choice's parsers, and the ids of the calls it started."""

    parser: ToolCallParser | None
    reasoning: ReasoningParser | None = None
    ids: dict[int, str] = attrs.field(factory=dict)
    #: false: the thinking is dropped (``include_reasoning: false``)
    include_reasoning: bool = True
    _answer: AnswerParser = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._answer = AnswerParser(self.parser, self.reasoning)

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def delta(self, text: str, finished: bool) -> ChatDelta:
        """The delta for ``text`` (and the parser's leftovers when finished)."""
        thought, events = self._answer.feed(text, finished)
        return self._delta(thought if self.include_reasoning else "", events)

    def _delta(self, thought: str, events: list[ToolEvent]) -> ChatDelta:
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
        if thought:
            fields["reasoning_content"] = thought
        if content:
            fields["content"] = "".join(content)
        if calls:
            fields["tool_calls"] = [ToolCallDelta.model_validate(c) for c in calls]
        return ChatDelta(**fields)
