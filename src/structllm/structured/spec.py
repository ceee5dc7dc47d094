"""What a request asks its output to match: :class:`StructuredOutputs`.

This module belongs to the types layer (attrs and :mod:`structllm.errors`
only): it is a field of :class:`~structllm.params.SamplingParams` and
travels to the engine core, so it never imports the grammar library. Every
field is checked when the object is built; a bad value raises
:class:`~structllm.errors.InvalidRequestError` whose ``field`` is
``"structured_outputs.<name>"`` (or ``"structured_outputs"`` when the kinds
are mixed up).

The five kinds follow vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar``) plus OpenAI's ``json_object``:

==============  ============================================================
``json``        a JSON Schema (a dict, or a string holding one)
``json_object`` any JSON object (OpenAI ``{"type": "json_object"}``)
``regex``       the whole output matches the regex (Rust ``regex`` syntax,
                no look-around or back-references)
``choice``      the whole output is exactly one of the strings
``grammar``     a Lark grammar, llguidance's dialect (``start:`` is the
                root; ``/regex/`` terminals; ``%json {...}`` embeds a
                schema); a GBNF grammar (``root ::= ...``) is converted
==============  ============================================================
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from structllm.errors import InvalidRequestError

__all__ = ["MAX_SPEC_CHARS", "StructuredOutputKind", "StructuredOutputs"]

#: The longest schema (as canonical JSON), regex, grammar or joined choice list.
MAX_SPEC_CHARS = 256 * 1024

StructuredOutputKind = Literal["json", "json_object", "regex", "choice", "grammar"]

_PREFIX = "structured_outputs"


def _fail(name: str, value: object, expected: str) -> InvalidRequestError:
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return InvalidRequestError(
        f"{_PREFIX}.{name} must be {expected}, got {shown}", field=f"{_PREFIX}.{name}"
    )


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _canonical_json(value: Any) -> str:
    """Compact JSON that keeps key order: a schema's ``properties`` order is
    the order the output's keys are generated in (as OpenAI does)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _to_json(value: object) -> str | None:
    """A JSON Schema as a dict or a JSON string, kept as compact JSON text."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise _fail("json", value, "a JSON Schema (valid JSON)") from None
    if not isinstance(value, Mapping):
        raise _fail("json", value, "a JSON Schema object")
    try:
        text = _canonical_json(value)
    except (TypeError, ValueError, RecursionError):
        raise _fail("json", value, "a JSON-serialisable JSON Schema") from None
    if not _encodable(text):
        raise _fail("json", value, "valid Unicode (no lone surrogates)")
    if len(text) > MAX_SPEC_CHARS:
        raise _fail("json", f"<{len(text)} characters>", f"<= {MAX_SPEC_CHARS} chars")
    return text


def _text(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _fail(name, value, "a non-empty string")
    if not _encodable(value):
        raise _fail(name, value, "valid Unicode (no lone surrogates)")
    if len(value) > MAX_SPEC_CHARS:
        raise _fail(name, f"<{len(value)} characters>", f"<= {MAX_SPEC_CHARS} chars")
    return value


def _to_regex(value: object) -> str | None:
    return _text("regex", value)


def _to_grammar(value: object) -> str | None:
    return _text("grammar", value)


def _to_choice(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise _fail("choice", value, "a list of strings")
    if not value or not all(isinstance(c, str) for c in value):
        raise _fail("choice", value, "a non-empty list of strings")
    if not all(_encodable(c) for c in value):
        raise _fail("choice", value, "valid Unicode (no lone surrogates)")
    if sum(len(c) for c in value) > MAX_SPEC_CHARS:
        raise _fail("choice", f"<{len(value)} strings>", f"<= {MAX_SPEC_CHARS} chars")
    return tuple(dict.fromkeys(value))  # duplicates dropped, order kept


def _to_json_object(value: object) -> bool:
    if not isinstance(value, bool):
        raise _fail("json_object", value, "true or false")
    return value


@attrs.frozen(kw_only=True)
class StructuredOutputs:
    """Constrain a request's output; set exactly one field.

    ``json`` accepts a dict or a JSON string and is stored as compact JSON
    (no spaces, key order kept: the output's keys come in the schema's
    order), so equal schemas compare and hash equal and :attr:`key` can
    index a compiled-grammar cache; the same schema with its keys in another
    order is another constraint. Choices keep their order and lose
    duplicates.
    """

    json: str | None = attrs.field(default=None, converter=_to_json)
    json_object: bool = attrs.field(default=False, converter=_to_json_object)
    regex: str | None = attrs.field(default=None, converter=_to_regex)
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_to_choice)
    grammar: str | None = attrs.field(default=None, converter=_to_grammar)

    def __attrs_post_init__(self) -> None:
        kinds = self._set_kinds()
        if len(kinds) != 1:
            given = ", ".join(kinds) if kinds else "none"
            raise InvalidRequestError(
                f"{_PREFIX} must set exactly one of json, json_object, regex, "
                f"choice, grammar; got {given}",
                field=_PREFIX,
            )

    def _set_kinds(self) -> list[StructuredOutputKind]:
        kinds: list[StructuredOutputKind] = []
        if self.json is not None:
            kinds.append("json")
        if self.json_object:
            kinds.append("json_object")
        if self.regex is not None:
            kinds.append("regex")
        if self.choice is not None:
            kinds.append("choice")
        if self.grammar is not None:
            kinds.append("grammar")
        return kinds

    @property
    def kind(self) -> StructuredOutputKind:
        """Which of the fields is set."""
        return self._set_kinds()[0]

    @property
    def field(self) -> str:
        """The field's path for error messages: ``"structured_outputs.json"``."""
        return f"{_PREFIX}.{self.kind}"

    @property
    def spec(self) -> str:
        """The canonical text of the constraint (choices as a JSON list)."""
        if self.json is not None:
            return self.json
        if self.regex is not None:
            return self.regex
        if self.choice is not None:
            return _canonical_json(list(self.choice))
        if self.grammar is not None:
            return self.grammar
        return ""

    @property
    def key(self) -> tuple[StructuredOutputKind, str]:
        """``(kind, canonical spec)``: equal keys compile to the same grammar."""
        return (self.kind, self.spec)

    def json_schema(self) -> dict[str, Any]:
        """The ``json`` schema as a fresh dict (raises if ``json`` is unset)."""
        if self.json is None:
            raise ValueError("this StructuredOutputs has no json schema")
        schema: dict[str, Any] = json.loads(self.json)
        return schema

    @classmethod
    def from_response_format(cls, value: object) -> StructuredOutputs | None:
        """Read OpenAI's ``response_format``; ``None`` for ``{"type": "text"}``.

        ``{"type": "json_object"}`` and ``{"type": "json_schema",
        "json_schema": {"name": ..., "schema": {...}}}`` are understood; a
        ``json_schema`` without ``schema`` means any JSON object. Errors name
        ``response_format`` or the sub-field at fault.
        """
        field = "response_format"
        if not isinstance(value, Mapping):
            raise InvalidRequestError(
                f"{field} must be an object, got {value!r}", field=field
            )
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            inner = value.get("json_schema")
            if not isinstance(inner, Mapping):
                raise InvalidRequestError(
                    f"{field}.json_schema must be an object, got {inner!r}",
                    field=f"{field}.json_schema",
                )
            schema = inner.get("schema")
            if schema is None:
                return cls(json_object=True)
            try:
                return cls(json=schema)
            except InvalidRequestError as exc:
                raise InvalidRequestError(
                    str(exc).replace(f"{_PREFIX}.json", f"{field}.json_schema.schema"),
                    field=f"{field}.json_schema.schema",
                ) from None
        raise InvalidRequestError(
            f"{field}.type must be 'text', 'json_object' or 'json_schema', "
            f"got {kind!r}",
            field=f"{field}.type",
        )
