"""The events of a streamed message.

Anthropic's stream is ``message_start``, ``ping``, then for each content
block ``content_block_start``, its deltas (``text_delta`` or
``input_json_delta``) and ``content_block_stop``, then ``message_delta``
(``stop_reason``, ``stop_sequence``, the output tokens) and
``message_stop``; a failure after the 200 is an ``error`` event. Each is an
SSE event named after its ``type`` (the ``anthropic`` client skips events
without a name) and there is no ``[DONE]``.

:class:`MessageEvents` is the pure part: it turns the engine's text deltas
into events, the thinking split off first when there is a reasoning parser
(a ``thinking`` block of ``thinking_delta`` events, closed by an empty
``signature_delta`` as llama.cpp sends), then through the request's
tool-call parser when there is one
(:mod:`~structllm.text.tool_parser`: text becomes text blocks, each call a
``tool_use`` block whose input arrives as JSON fragments). Whitespace at the
end of the text is held back until more text follows: before a call it is
dropped, as the text block of a whole answer with calls leaves it out. A message whose
answer is empty still has one (empty) text block, as a whole response does.
:class:`~structllm.server.http.sse.EventStream` with ``named=True`` carries
them.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

import attrs
from pydantic import BaseModel

from structllm.outputs import CompletionOutput
from structllm.server.chat.tool_calls import AnswerParser
from structllm.server.messages.response import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJsonDelta,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessageStopEvent,
    SignatureDelta,
    StopReason,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
)
from structllm.text.reasoning import ReasoningParser
from structllm.text.tool_parser import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallParser,
)

__all__ = [
    "EmitEvent",
    "MessageEvents",
    "new_tool_use_id",
    "stop_reason",
]

#: sends one named event: its ``type`` names it
EmitEvent = Callable[[BaseModel], Awaitable[None]]


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(
    c: CompletionOutput, called: bool
) -> tuple[StopReason | None, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a finished output."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.finish_reason != "stop":
        return None, None  # aborted or failed: no answer reaches the client
    if called:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


@attrs.define
class MessageEvents:
    """One streamed message's blocks: which is open, and the calls seen."""

    #: the request's tool-call parser; None: every delta is text
    parser: ToolCallParser | None
    #: splits the thinking off first (a thinking block); None: no reasoning
    reasoning: ReasoningParser | None = None
    #: the open block's index and type (-1, None before the first)
    index: int = -1
    open: str | None = None
    called: bool = False
    #: whitespace at the end of the text so far, held back: it is sent
    #: before more text, and dropped before a call (as a whole answer's
    #: text block leaves it out)
    pending: str = ""
    _answer: AnswerParser = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._answer = AnswerParser(self.parser, self.reasoning)

    def feed(self, text: str, finished: bool) -> list[BaseModel]:
        """The events for the next piece of the answer."""
        thought, events = self._answer.feed(text, finished)
        out: list[BaseModel] = []
        if thought:
            if self.open != "thinking":
                out += self._start(ThinkingBlock(thinking=""))
            delta = ThinkingDelta(thinking=thought)
            out.append(ContentBlockDeltaEvent(index=self.index, delta=delta))
        for e in events:
            if isinstance(e, ContentDelta):
                text = e.text.rstrip()
                if not text:
                    self.pending += e.text
                    continue
                out += self._text(self.pending + text)
                self.pending = e.text[len(text) :]
            elif isinstance(e, CallStart):
                self.pending = ""
                block = ToolUseBlock(id=new_tool_use_id(), name=e.name, input={})
                out += self._start(block)
                self.called = True
            elif isinstance(e, ArgumentsDelta) and e.text:
                # a call's arguments follow its start: the open block
                partial = InputJsonDelta(partial_json=e.text)
                out.append(ContentBlockDeltaEvent(index=self.index, delta=partial))
        return out

    def finish(self, c: CompletionOutput, output_tokens: int) -> list[BaseModel]:
        """Close the open block (opening an empty text block if the answer
        has none), then ``message_delta`` and ``message_stop``."""
        out: list[BaseModel] = []
        if self.pending and not self.called:
            out += self._text(self.pending)
        self.pending = ""
        if self.open in (None, "thinking"):
            out += self._start(TextBlock(text=""))
        out += self._close()
        reason, sequence = stop_reason(c, self.called)
        out.append(
            MessageDeltaEvent(
                delta=MessageDelta(stop_reason=reason, stop_sequence=sequence),
                usage=MessageDeltaUsage(output_tokens=output_tokens),
            )
        )
        out.append(MessageStopEvent())
        return out

    def _text(self, text: str) -> list[BaseModel]:
        """A text delta, opening a text block first if none is open."""
        out = [] if self.open == "text" else self._start(TextBlock(text=""))
        out.append(ContentBlockDeltaEvent(index=self.index, delta=TextDelta(text=text)))
        return out

    def _start(
        self, block: ThinkingBlock | TextBlock | ToolUseBlock
    ) -> list[BaseModel]:
        out = self._close()
        self.index += 1
        self.open = block.type
        out.append(ContentBlockStartEvent(index=self.index, content_block=block))
        return out

    def _close(self) -> list[BaseModel]:
        """Close the open block: a thinking block ends with its signature."""
        out: list[BaseModel] = []
        if self.open == "thinking":
            out.append(ContentBlockDeltaEvent(index=self.index, delta=SignatureDelta()))
        if self.open is not None:
            out.append(ContentBlockStopEvent(index=self.index))
        self.open = None
        return out
