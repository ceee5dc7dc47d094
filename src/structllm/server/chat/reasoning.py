"""Reasoning on the serving side: which parser, one per choice, and an output
constraint that leaves the thinking free.

``--reasoning-parser`` names a parser of :mod:`structllm.text.reasoning`,
``none``, or ``auto``: the one the model's chat template calls for, if
that is clear (:func:`parser_name`). Each choice gets its own parser, which
knows from the rendered prompt whether the output starts inside the
thinking (:func:`choice_parser`).

Structured output applies to the answer, not the thinking
(:func:`after_thinking`): a JSON schema, JSON object, choice list or regex
becomes a Lark grammar that first lets the model think, up to
``</think>``, when the output starts in the reasoning (or, under
``qwen3``, may open ``<think>`` itself). A Lark grammar of the request's own
is kept as it is, and the whole output is its answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from structllm.structured import StructuredOutputs
from structllm.text.reasoning import (
    THINK_START,
    ReasoningParser,
    new_parser,
    parser_for_template,
)

__all__ = ["after_thinking", "choice_parser", "parser_name"]

#: compact JSON, as the engine's compiler writes it (``compiler._json_options``)
_COMPACT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
#: text up to and with the first ``</think>`` (derivre's & and ~)
_THINKING = "THINKING: /(.|\\n)*<\\/think>/ & ~/(.|\\n)*<\\/think>(.|\\n)+/"


def parser_name(setting: str, template: str | None) -> str | None:
    """The parser ``--reasoning-parser`` and the chat template call for."""
    if setting == "none":
        return None
    if setting == "auto":
        return parser_for_template(template)
    return setting


def choice_parser(
    name: str | None, prompt: str, template_kwargs: Mapping[str, Any] | None
) -> ReasoningParser | None:
    """A fresh parser for one choice of ``prompt`` (None: no reasoning)."""
    return None if name is None else new_parser(name, prompt, template_kwargs)


def _answer_rule(c: StructuredOutputs) -> str | None:
    if c.json is not None or c.json_object:
        schema: dict[str, Any] = (
            c.json_schema() if c.json is not None else {"type": "object"}
        )
        schema["x-guidance"] = _COMPACT
        return f"%json {json.dumps(schema)}"
    if c.choice is not None:
        return " | ".join(json.dumps(s) for s in c.choice)
    if c.regex is not None:
        return "/" + c.regex.replace("/", "\\/") + "/"
    return None


def after_thinking(
    c: StructuredOutputs | None, parser: ReasoningParser | None
) -> tuple[StructuredOutputs | None, ReasoningParser | None]:
    """``c`` held to the answer only, and the parser that goes with it."""
    if c is None or parser is None or parser.reasoning_ended:
        return c, parser
    answer = _answer_rule(c)
    if answer is None:  # a grammar of the request's own: the whole output
        return c, ReasoningParser("answer")
    thinking = "THINKING /[ \\n]*/"
    if parser.mode == "answer_start":  # the model may open <think> itself
        thinking = f"({json.dumps(THINK_START)} {thinking})?"
    grammar = f"start: {thinking} answer\n{_THINKING}\nanswer: {answer}\n"
    return StructuredOutputs(grammar=grammar), parser
