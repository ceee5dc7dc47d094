"""Reasoning apart from the answer: ``<think>...</think>`` out of generated text.

Reasoning models (Qwen3, DeepSeek-R1 and their kin) write their thinking
between ``<think>`` and ``</think>``, then the answer. A
:class:`ReasoningParser` is fed one choice's text as it is generated and
returns, for each piece, the reasoning and the answer it holds
(:class:`ReasoningDelta`); a tag split across pieces (``</thi`` + ``nk>``)
is held back until it is known, so the split never depends on where the
tokens fell, and :func:`split` (the parser run once) is what a streamed
answer adds up to.

Where the output starts depends on the prompt as well as on the parser:

- A prompt that ends inside an open ``<think>`` (DeepSeek-R1's template
  writes one after the generation prompt; so does a continued assistant
  message that opened one) starts in the reasoning; one that closed it
  (Qwen3 with ``enable_thinking: false`` writes an empty
  ``<think>\\n\\n</think>``) starts in the answer.
- Otherwise ``qwen3`` starts in the answer, which may open with
  ``<think>`` (Qwen3 writes it itself), and ``deepseek_r1`` starts in the
  reasoning (its models often leave the ``<think>`` out): everything before
  ``</think>`` is reasoning.
- ``enable_thinking: false`` asked of the template: the whole output is
  the answer.

The reasoning is sent without the whitespace around it, the answer without
the whitespace that follows ``</think>``. A reasoning block cut short
(``max_tokens``) leaves the answer empty.

:func:`parser_for_template` names the parser a chat template calls for
when that is unambiguous (``--reasoning-parser auto``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

__all__ = [
    "REASONING_PARSERS",
    "THINK_END",
    "THINK_START",
    "ReasoningDelta",
    "ReasoningParser",
    "new_parser",
    "parser_for_template",
    "split",
]

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")

_Mode = Literal["reasoning", "answer_start", "answer"]


@attrs.frozen
class ReasoningDelta:
    """The reasoning and the answer in one piece of text (either may be empty)."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: ReasoningDelta) -> ReasoningDelta:
        return ReasoningDelta(
            self.reasoning + other.reasoning, self.content + other.content
        )


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that starts ``tag`` (0 if none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@attrs.define
class ReasoningParser:
    """One choice's text, split as it streams (``feed``, then ``finish``)."""

    mode: _Mode
    #: text not yet known to be reasoning or answer
    _held: str = ""
    #: at the start of a block: its leading whitespace (and a tag) are dropped
    _fresh: bool = True
    #: the answer's leading whitespace is dropped (it follows ``</think>``)
    _strip_answer: bool = False
    #: the reasoning's ``<think>`` has been read (a second one is text)
    _opened: bool = False

    @property
    def reasoning_ended(self) -> bool:
        """The answer has begun (what follows is answer whatever it says)."""
        return self.mode == "answer"

    def feed(self, text: str) -> ReasoningDelta:
        self._held += text
        out = ReasoningDelta()
        while True:
            step, more = self._step()
            out += step
            if not more:
                return out

    def finish(self) -> ReasoningDelta:
        """What is held back, now that no more text comes."""
        held, self._held = self._held, ""
        if self.mode == "reasoning":
            return ReasoningDelta(
                reasoning=held.strip() if self._fresh else held.rstrip()
            )
        if self._strip_answer:
            held = held.lstrip()
        return ReasoningDelta(content=held)

    def _step(self) -> tuple[ReasoningDelta, bool]:
        """Classify what can be classified; whether the mode changed."""
        held = self._held
        if self.mode == "answer":
            self._held = ""
            return ReasoningDelta(content=held), False
        if self.mode == "answer_start":
            rest = held.lstrip()
            if rest.startswith(THINK_START):
                self._held = rest[len(THINK_START) :]
                self.mode, self._fresh, self._opened = "reasoning", True, True
                return ReasoningDelta(), True
            if THINK_START.startswith(rest):  # "" or a part of the tag
                return ReasoningDelta(), False
            self._held = ""
            self.mode = "answer"
            return ReasoningDelta(content=rest if self._strip_answer else held), False
        # reasoning
        if self._fresh:
            rest = held.lstrip()
            if not self._opened and rest.startswith(THINK_START):
                # a tag the prompt did not write
                rest = rest[len(THINK_START) :].lstrip()
                self._opened = True
            elif not self._opened and THINK_START.startswith(rest):
                return ReasoningDelta(), False
            if not rest:
                self._held = ""
                return ReasoningDelta(), False
            held = self._held = rest
            self._fresh = False
        end = held.find(THINK_END)
        if end >= 0:
            self._held = held[end + len(THINK_END) :]
            self.mode, self._strip_answer = "answer_start", True
            return ReasoningDelta(reasoning=held[:end].rstrip()), True
        # hold a part of the closing tag, and trailing whitespace before it
        keep = _held_prefix(held, THINK_END)
        body = held[: len(held) - keep]
        sent = body.rstrip()
        self._held = held[len(sent) :]
        return ReasoningDelta(reasoning=sent), False


def _prompt_state(prompt: str) -> Literal["open", "closed", "none"]:
    start, end = prompt.rfind(THINK_START), prompt.rfind(THINK_END)
    if start < 0 and end < 0:
        return "none"
    return "open" if start > end else "closed"


def new_parser(
    name: str, prompt: str, template_kwargs: Mapping[str, Any] | None = None
) -> ReasoningParser:
    """The parser ``name`` for an output that continues ``prompt``."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"no reasoning parser {name!r}; one of {REASONING_PARSERS}")
    if (template_kwargs or {}).get("enable_thinking") is False:
        return ReasoningParser("answer")
    state = _prompt_state(prompt)
    if state == "open" or (state == "none" and name == "deepseek_r1"):
        return ReasoningParser("reasoning")
    return ReasoningParser("answer_start")


def split(parser: ReasoningParser, text: str) -> ReasoningDelta:
    """Run ``parser`` over the whole ``text``."""
    return parser.feed(text) + parser.finish()


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template calls for, or None when it is not clear.

    DeepSeek-R1's templates open ``<think>`` after the generation prompt
    (``<｜Assistant｜>``); Qwen3's switch thinking on ``enable_thinking``.
    A template that never mentions ``</think>`` is not a reasoning model's.
    """
    if not template or THINK_END not in template:
        return None
    deepseek = "<｜Assistant｜>" in template
    qwen = "enable_thinking" in template or "<|im_start|>" in template
    if deepseek == qwen:
        return None
    return "deepseek_r1" if deepseek else "qwen3"
