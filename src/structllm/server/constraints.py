"""Check a request's output constraint before it reaches the engine.

:func:`check_constraint` asks llguidance whether a
:class:`~structllm.structured.StructuredOutputs` compiles (without a
vocabulary: ~0.1-1 ms for the schemas requests carry) and raises
:class:`~structllm.errors.InvalidRequestError` naming the *request's* field
(``response_format.json_schema.schema``, ``tools[0].function.parameters``,
``structured_outputs.regex``), which the engine's own compiler cannot know:
it only sees ``structured_outputs.<kind>``. The request is refused with a
400 before anything is promised, streaming or not.

The grammar text is built as :class:`~structllm.structured.GrammarCompiler`
builds it (JSON whitespace does not change what compiles);
:func:`rename_field` maps an error the engine raises anyway back to the
request's field.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from structllm.errors import InvalidRequestError
from structllm.structured import StructuredOutputs

__all__ = ["check_constraint", "rename_field", "renamed"]

_MAX_REASON = 500


def _grammar_text(c: StructuredOutputs) -> str:
    matcher = llguidance.LLMatcher
    if c.json is not None:
        return matcher.grammar_from_json_schema(c.json)
    if c.json_object:
        return matcher.grammar_from_json_schema({"type": "object"})
    if c.regex is not None:
        return matcher.grammar_from_regex(c.regex)
    if c.choice is not None:
        return matcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(s) for s in c.choice)
        )
    assert c.grammar is not None
    return matcher.grammar_from_lark(any_to_lark(c.grammar))


def check_constraint(c: StructuredOutputs, field: str) -> None:
    """Raise InvalidRequestError naming ``field`` if ``c`` does not compile."""
    try:
        reason = llguidance.LLMatcher.validate_grammar(_grammar_text(c))
    except Exception as exc:  # llguidance raises ValueError; the GBNF converter
        reason = str(exc) or type(exc).__name__  # (pure Python) anything
    if reason:
        reason = reason.strip()
        if len(reason) > _MAX_REASON:
            reason = reason[:_MAX_REASON] + "..."
        raise InvalidRequestError(f"{field}: does not compile: {reason}", field=field)


def rename_field(exc: InvalidRequestError, field: str | None) -> InvalidRequestError:
    """``exc`` naming ``field`` instead of ``structured_outputs[.kind]``."""
    own = exc.field or ""
    if field is None or field == own or not own.startswith("structured_outputs"):
        return exc
    message = str(exc).replace(own, field, 1)
    return InvalidRequestError(message, field=field)


@contextlib.contextmanager
def renamed(field: str | None) -> Iterator[None]:
    """Errors about the constraint from the engine name ``field`` instead.

    Also inside an exception group (the requests of one response run in a
    task group): a group whose first leaf is such an error is replaced by
    the renamed error.
    """
    try:
        yield
    except InvalidRequestError as exc:
        raise rename_field(exc, field) from None
    except BaseExceptionGroup as group:
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        if (
            isinstance(leaf, InvalidRequestError)
            and rename_field(leaf, field) is not leaf
        ):
            raise rename_field(leaf, field) from None
        raise
