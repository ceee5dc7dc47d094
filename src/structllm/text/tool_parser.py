"""Tool calls out of generated text, whole or as it streams.

A parser is fed the text of one choice as it is generated (``feed``) and
then told it ended (``finish``); it returns events: content text, the start
of a call (its index and name) and fragments of a call's arguments (JSON
text). :func:`parse` runs one over a whole text, so a streamed answer and
a whole one are the same by construction.

Three parsers, one per ``tool_choice`` (:class:`AutoParser` is in
:mod:`structllm.text.auto_tool_parser`):

- :class:`NamedCallParser` (a named function): the whole output is the
  function's arguments, a JSON object (the grammar makes it so).
- :class:`CallListParser` (``"required"``): the output is a JSON list
  ``[{"name": "f", "parameters": {...}}, ...]`` (the grammar makes it so);
  followed character by character, so each call's name is sent as soon as
  it is complete and its arguments as they are generated.
- :class:`~structllm.text.auto_tool_parser.AutoParser` (``"auto"``): free
  text, in which it finds Hermes/Qwen ``<tool_call>`` blocks, or a whole
  output of JSON calls (Llama 3, Mistral).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Protocol

import attrs

__all__ = [
    "NOT_JSON",
    "ArgumentsDelta",
    "CallListParser",
    "CallStart",
    "ContentDelta",
    "NamedCallParser",
    "ParsedCall",
    "ParsedOutput",
    "ToolCallParser",
    "ToolEvent",
    "collect",
    "loads_or_not_json",
    "parse",
]

ARGUMENT_KEYS = ("parameters", "arguments")


@attrs.frozen
class ContentDelta:
    text: str


@attrs.frozen
class CallStart:
    index: int
    name: str


@attrs.frozen
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = ContentDelta | CallStart | ArgumentsDelta


class ToolCallParser(Protocol):
    def feed(self, text: str) -> list[ToolEvent]: ...
    def finish(self) -> list[ToolEvent]: ...

    @property
    def complete(self) -> bool:
        """Every call started was closed (False for an output cut short)."""
        ...


@attrs.frozen
class ParsedCall:
    name: str
    #: the arguments, JSON text of an object
    arguments: str


@attrs.frozen
class ParsedOutput:
    #: the text outside the calls; None when there is none but whitespace
    content: str | None
    calls: tuple[ParsedCall, ...]
    complete: bool


def collect(events: Iterable[ToolEvent], *, complete: bool = True) -> ParsedOutput:
    """The content and calls a sequence of events adds up to."""
    content: list[str] = []
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, CallStart):
            names[e.index] = e.name
            arguments.setdefault(e.index, [])
        else:
            arguments.setdefault(e.index, []).append(e.text)
    calls = tuple(ParsedCall(names[i], "".join(arguments[i])) for i in sorted(names))
    text = "".join(content)
    return ParsedOutput(text if text.strip() else None, calls, complete)


def parse(parser: ToolCallParser, text: str) -> ParsedOutput:
    """Run ``parser`` over the whole ``text``."""
    events = parser.feed(text) + parser.finish()
    return collect(events, complete=parser.complete)


# -- a named function -------------------------------------------------------------


@attrs.define
class NamedCallParser:
    """The output is the arguments of the one call to ``name``."""

    name: str
    _started: bool = attrs.field(default=False, init=False)
    _text: list[str] = attrs.field(factory=list, init=False)

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if not self._started:
            self._started = True
            out.append(CallStart(0, self.name))
        if text:
            self._text.append(text)
            out.append(ArgumentsDelta(0, text))
        return out

    def finish(self) -> list[ToolEvent]:
        return self.feed("")

    @property
    def complete(self) -> bool:
        return isinstance(loads_or_not_json("".join(self._text)), dict)


# -- "required": a JSON list of calls -----------------------------------------------


@attrs.define
class CallListParser:
    """Follows ``[{"name": "f", "parameters": {...}}, ...]`` as it grows.

    Whitespace between tokens is allowed; ``arguments`` is taken for
    ``parameters``; arguments seen before the name are held until it comes.
    Anything else (a string for the arguments, a value that is not a list)
    stops the parser, and ``complete`` stays False.
    """

    _depth: int = attrs.field(default=0, init=False)  # 1: in the list, 2: in a call
    _in_string: bool = attrs.field(default=False, init=False)
    _escaped: bool = attrs.field(default=False, init=False)
    _string: list[str] = attrs.field(factory=list, init=False)
    _key: str | None = attrs.field(default=None, init=False)
    _after_colon: bool = attrs.field(default=False, init=False)
    #: nesting inside an object or list value of a call (0: not in one)
    _value_depth: int = attrs.field(default=0, init=False)
    _in_arguments: bool = attrs.field(default=False, init=False)
    _index: int = attrs.field(default=-1, init=False)
    _name: str | None = attrs.field(default=None, init=False)
    _has_arguments: bool = attrs.field(default=False, init=False)
    _pending: list[str] = attrs.field(factory=list, init=False)
    _failed: bool = attrs.field(default=False, init=False)
    _done: bool = attrs.field(default=False, init=False)

    @property
    def complete(self) -> bool:
        return self._done and not self._failed

    def finish(self) -> list[ToolEvent]:
        return []

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        for c in text:
            if self._failed:
                break
            self._char(c, out)
        self._flush(out)
        return out

    def _flush(self, out: list[ToolEvent]) -> None:
        if self._pending and self._name is not None:
            out.append(ArgumentsDelta(self._index, "".join(self._pending)))
            self._pending.clear()

    def _char(self, c: str, out: list[ToolEvent]) -> None:
        if self._value_depth:
            self._in_value(c, out)
        elif self._in_string:
            self._string_char(c, out)
        elif c in " \t\r\n":
            pass
        elif self._done:
            self._failed = True
        elif self._depth == 0:
            self._open(c == "[")
        elif self._depth == 1:
            self._in_list(c)
        elif c == '"':
            self._in_string = True
        elif c == ":":
            self._after_colon = True
        elif c == ",":
            self._key, self._after_colon = None, False
        elif c in "{[" and self._after_colon:
            self._value_depth = 1
            self._in_arguments = self._key in ARGUMENT_KEYS
            if self._in_arguments:
                self._pending.append(c)
        elif c == "}":
            self._failed = self._name is None or not self._has_arguments
            self._depth = 1
            self._flush(out)
        # other characters: numbers, true, false, null of other keys

    def _open(self, ok: bool) -> None:
        self._depth = 1
        self._failed = not ok

    def _in_list(self, c: str) -> None:
        if c == "{":
            self._depth = 2
            self._index += 1
            self._key, self._after_colon = None, False
            self._name, self._has_arguments = None, False
        elif c == "]":
            self._depth = 0
            self._done = True
        elif c != ",":
            self._failed = True

    def _string_char(self, c: str, out: list[ToolEvent]) -> None:
        if self._escaped:
            self._escaped = False
        elif c == "\\":
            self._escaped = True
        elif c == '"':
            self._in_string = False
            value = loads_or_not_json('"' + "".join(self._string) + '"')
            self._string.clear()
            if not isinstance(value, str):
                self._failed = True
            elif not self._after_colon:
                self._key = value
            elif self._key == "name" and self._name is None:
                self._name = value
                out.append(CallStart(self._index, value))
                self._flush(out)
            elif self._key in ARGUMENT_KEYS:
                self._failed = True  # arguments as a string: not this format
            return
        self._string.append(c)

    def _in_value(self, c: str, out: list[ToolEvent]) -> None:
        if self._in_arguments:
            self._pending.append(c)
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self._value_depth += 1
        elif c in "}]":
            self._value_depth -= 1
            if self._value_depth == 0 and self._in_arguments:
                self._in_arguments = False
                self._has_arguments = True
                self._flush(out)


#: what :func:`loads_or_not_json` returns for text that is not JSON
NOT_JSON = object()


def loads_or_not_json(text: str) -> Any:
    """``json.loads(text)``, or :data:`NOT_JSON` (never raises)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return NOT_JSON
