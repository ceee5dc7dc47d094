"""Tool calls in free text: :class:`AutoParser`, for ``tool_choice="auto"``.

It finds Hermes/Qwen blocks ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` anywhere in the text (the text around them is content),
or a whole output that is a JSON call object or a list of them (Llama 3:
``{"name": ..., "parameters": {...}}``), optionally after ``<|python_tag|>``
(Llama 3.1) or ``[TOOL_CALLS]`` (Mistral). A call object has ``name`` (one
of the tools), ``arguments`` or ``parameters`` (an object, or a string
holding one) and optionally ``"type": "function"``; anything else stays
content, as generated. A block is sent once it is closed; a bare JSON
output once the output ends (until then it might be JSON content). An
answer that starts otherwise than ``{"``, ``[{"`` or a prefix is content
from its first characters on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable
from typing import Any

import attrs

from structllm.text.tool_parser import (
    ARGUMENT_KEYS,
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ParsedCall,
    ToolEvent,
    loads_or_not_json,
)

__all__ = ["BARE_PREFIXES", "HERMES_CLOSE", "HERMES_OPEN", "AutoParser"]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
#: prefixes a bare JSON call may follow (Llama 3.1, Mistral)
BARE_PREFIXES = ("<|python_tag|>", "[TOOL_CALLS]")


def _frozenset(names: Iterable[str]) -> frozenset[str]:
    return frozenset(names)


@attrs.define
class AutoParser:
    """Hermes blocks anywhere, or a whole output that is JSON calls.

    Content is passed through as generated, except whitespace, which is
    held until more content follows: an output of calls and whitespace has
    no content. With ``parallel`` false only the first call is kept.
    """

    names: frozenset[str] = attrs.field(converter=_frozenset)
    parallel: bool = True
    _mode: str = attrs.field(default="start", init=False)
    _buffer: str = attrs.field(default="", init=False)
    _held: str = attrs.field(default="", init=False)
    _saw_text: bool = attrs.field(default=False, init=False)
    _calls: int = attrs.field(default=0, init=False)

    complete = True

    def feed(self, text: str) -> list[ToolEvent]:
        self._buffer += text
        out: list[ToolEvent] = []
        self._advance(out, final=False)
        return out

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        self._advance(out, final=True)
        if self._held and (self._saw_text or not self._calls):
            out.append(ContentDelta(self._held))
        self._held = ""
        return out

    def _advance(self, out: list[ToolEvent], *, final: bool) -> None:
        while True:
            if self._mode == "start":  # no content yet; maybe bare JSON calls
                head = self._buffer.lstrip()
                if not head:
                    if final:
                        self._content(self._buffer, out)
                        self._buffer = ""
                    return
                start = _bare_start(head)
                if start == "calls" and final:
                    calls = _bare_calls(self._buffer, self.names)
                    if calls is None:
                        self._content(self._buffer, out)
                    for call in calls or ():
                        self._call(call, out)
                    self._buffer = ""
                    return
                if not final and (start != "no" or HERMES_OPEN.startswith(head)):
                    return  # it may still be calls, or a block's tag
                self._mode = "content"
            elif self._mode == "content":
                i = self._buffer.find(HERMES_OPEN)
                if i >= 0:
                    self._content(self._buffer[:i], out)
                    self._buffer = self._buffer[i + len(HERMES_OPEN) :]
                    self._mode = "block"
                    continue
                keep = 0 if final else _partial_suffix(self._buffer, HERMES_OPEN)
                cut = len(self._buffer) - keep
                self._content(self._buffer[:cut], out)
                self._buffer = self._buffer[cut:]
                return
            else:  # in a <tool_call> block
                j = self._buffer.find(HERMES_CLOSE)
                if j < 0 and not final:
                    return
                inner = self._buffer if j < 0 else self._buffer[:j]
                close = "" if j < 0 else HERMES_CLOSE
                self._buffer = self._buffer[len(inner) + len(close) :]
                found = _call(loads_or_not_json(inner.strip()), self.names)
                if found is None:
                    self._content(HERMES_OPEN + inner + close, out)
                else:
                    self._call(found, out)
                self._mode = "content"

    def _content(self, text: str, out: list[ToolEvent]) -> None:
        if not text:
            return
        if text.strip():
            out.append(ContentDelta(self._held + text))
            self._held = ""
            self._saw_text = True
        else:
            self._held += text

    def _call(self, call: ParsedCall, out: list[ToolEvent]) -> None:
        if self._calls == 0 or self.parallel:
            out.append(CallStart(self._calls, call.name))
            out.append(ArgumentsDelta(self._calls, call.arguments))
        self._calls += 1


def _call(value: Any, names: Collection[str]) -> ParsedCall | None:
    """A call object as :class:`ParsedCall`, or None if it is not one."""
    if not isinstance(value, dict) or not set(value) <= {
        "name",
        "type",
        *ARGUMENT_KEYS,
    }:
        return None
    name = value.get("name")
    given = [value[k] for k in ARGUMENT_KEYS if k in value]
    if not isinstance(name, str) or name not in names or len(given) != 1:
        return None
    if value.get("type", "function") != "function":
        return None
    arguments = given[0]
    if isinstance(arguments, str):
        arguments = loads_or_not_json(arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def _bare_calls(text: str, names: Collection[str]) -> list[ParsedCall] | None:
    body = text.strip()
    for prefix in BARE_PREFIXES:
        body = body.removeprefix(prefix)
    value = loads_or_not_json(body)
    items = value if isinstance(value, list) else [value]
    calls = [_call(v, names) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


#: how a bare JSON call (or list of them) starts: ``[{"``, ``{"``, or less
_CALL_START = re.compile(r'(\[\s*)?(\{\s*("|$)|$)')


def _bare_start(head: str) -> str:
    """``"calls"`` if ``head`` can begin bare JSON calls, ``"maybe"`` if it
    can begin a prefix (``<|python_tag|>``), else ``"no"``."""
    body = head
    for prefix in BARE_PREFIXES:
        if head.startswith(prefix):
            body = head[len(prefix) :].lstrip()
            break
        if prefix.startswith(head):
            return "maybe"
    return "calls" if _CALL_START.match(body) else "no"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
