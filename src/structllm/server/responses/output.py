"""The output of one ``/v1/responses`` response, built as its text arrives.

:class:`Output` takes the deltas of chat's
:class:`~structllm.server.chat.tool_calls.AnswerParser` (reasoning split
off, then calls found in the answer) and makes the output items: a
``reasoning`` item, ``message`` items, ``function_call`` items, in the order
the model wrote them, with the events the openai SDK reads
(``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``, ... ``response.output_item.done``). A whole
response is the same builder fed once, so the two cannot differ.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from typing import Any, Literal

import attrs
from pydantic import BaseModel

from structllm.server.chat import tool_calls
from structllm.server.chat.tool_calls import AnswerParser
from structllm.server.responses.objects import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningText,
    TextDeltaEvent,
    TextDoneEvent,
)
from structllm.text.tool_parser import ArgumentsDelta, CallStart, ContentDelta

__all__ = ["Output", "new_id"]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@attrs.define
class _Item:
    """An output item as it is built."""

    kind: Literal["reasoning", "message", "function_call"]
    id: str
    index: int
    parts: list[str] = attrs.field(factory=list)
    name: str = ""
    call_id: str = ""
    #: the parser's index of the call (function_call items)
    call_index: int = -1
    status: ItemStatus = "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def model(self) -> OutputItem:
        """The item as sent (just added: no content yet)."""
        empty = not self.parts and self.status == "in_progress"
        if self.kind == "message":
            content = [] if empty else [OutputText(text=self.text)]
            return OutputMessage(id=self.id, status=self.status, content=content)
        if self.kind == "reasoning":
            thought = [] if empty else [ReasoningText(text=self.text)]
            return OutputReasoning(id=self.id, status=self.status, content=thought)
        return OutputFunctionCall(
            id=self.id,
            call_id=self.call_id,
            name=self.name,
            arguments=self.text,
            status=self.status,
        )


@attrs.define
class Output:
    """One output's items, built as its text arrives, and the events that
    tell a client about them."""

    answer: AnswerParser
    seq: Iterator[int] = attrs.field(factory=itertools.count)
    _items: list[_Item] = attrs.field(factory=list)
    #: whitespace that would open a message: sent with the text after it
    _blank: str = ""
    _events: list[BaseModel] = attrs.field(factory=list)

    def items(self) -> list[OutputItem]:
        return [item.model() for item in self._items]

    @property
    def reasoning_text(self) -> str:
        return "".join(i.text for i in self._items if i.kind == "reasoning")

    def messages(self) -> list[dict[str, Any]]:
        """The output as the assistant message a chat template receives."""
        text = "".join(i.text for i in self._items if i.kind == "message")
        calls = [
            {
                "id": i.call_id,
                "type": "function",
                "function": {"name": i.name, "arguments": i.text},
            }
            for i in self._items
            if i.kind == "function_call" and i.status == "completed"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return [message]

    def feed(self, text: str, *, finished: bool, cut: bool) -> list[BaseModel]:
        """The events ``text`` makes (all items closed when ``finished``)."""
        thought, events = self.answer.feed(text, finished)
        if thought:
            self._add("reasoning", thought)
        for e in events:
            if isinstance(e, ContentDelta):
                self._content(e.text)
            elif isinstance(e, CallStart):
                self._open("function_call", name=e.name, call_index=e.index)
            elif isinstance(e, ArgumentsDelta) and e.text:
                self._add("function_call", e.text)
        if finished:
            self._close("incomplete" if cut else "completed")
        out, self._events = self._events, []
        return out

    @property
    def _current(self) -> _Item | None:
        item = self._items[-1] if self._items else None
        return item if item is not None and item.status == "in_progress" else None

    def _content(self, text: str) -> None:
        current = self._current
        if current is None or current.kind != "message":
            if not (self._blank + text).strip():
                self._blank += text
                return
            text, self._blank = self._blank + text, ""
        self._add("message", text)

    def _open(
        self,
        kind: Literal["reasoning", "message", "function_call"],
        *,
        name: str = "",
        call_index: int = -1,
    ) -> _Item:
        self._close("completed")
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _Item(kind, new_id(prefix), len(self._items), name=name)
        if kind == "function_call":
            item.call_id = tool_calls.new_call_id()
            item.call_index = call_index
        self._items.append(item)
        self._event(
            OutputItemEvent,
            type="response.output_item.added",
            output_index=item.index,
            item=item.model(),
        )
        if kind != "function_call":
            part = OutputText(text="") if kind == "message" else ReasoningText(text="")
            self._part(item, "response.content_part.added", part)
        return item

    def _add(
        self, kind: Literal["reasoning", "message", "function_call"], text: str
    ) -> None:
        item = self._current
        if item is None or item.kind != kind:
            item = self._open(kind)
        item.parts.append(text)
        where = {"item_id": item.id, "output_index": item.index}
        if kind == "message":
            self._event(TextDeltaEvent, delta=text, content_index=0, **where)
        elif kind == "reasoning":
            self._event(ReasoningDeltaEvent, delta=text, content_index=0, **where)
        else:
            self._event(ArgumentsDeltaEvent, delta=text, **where)

    def _close(self, status: ItemStatus) -> None:
        item = self._current
        if item is None:
            return
        item.status = status
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "message":
            self._event(TextDoneEvent, text=item.text, content_index=0, **where)
            self._part(item, "response.content_part.done", OutputText(text=item.text))
        elif item.kind == "reasoning":
            self._event(ReasoningDoneEvent, text=item.text, content_index=0, **where)
            part = ReasoningText(text=item.text)
            self._part(item, "response.content_part.done", part)
        else:
            self._event(
                ArgumentsDoneEvent, name=item.name, arguments=item.text, **where
            )
        self._event(
            OutputItemEvent,
            type="response.output_item.done",
            output_index=item.index,
            item=item.model(),
        )

    def _part(
        self,
        item: _Item,
        kind: Literal["response.content_part.added", "response.content_part.done"],
        part: OutputText | ReasoningText,
    ) -> None:
        self._event(
            ContentPartEvent,
            type=kind,
            item_id=item.id,
            output_index=item.index,
            content_index=0,
            part=part,
        )

    def _event(self, model: type[BaseModel], **fields: Any) -> None:
        self._events.append(model(sequence_number=next(self.seq), **fields))
