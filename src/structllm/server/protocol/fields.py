"""The field types of the request models: ranges, shapes, valid Unicode.

Each annotated type validates one kind of OpenAI value and says what it
accepts in the JSON schema, so :mod:`structllm.server.protocol` declares a
field with one name (``max_tokens: Count | None``) and the OpenAPI document
tells the truth about it. A failure raises a ``PydanticCustomError`` whose
type names the field for :func:`structllm.server.protocol.validation.validation_error`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from structllm.engine.frontend.inputs import check_cache_salt
from structllm.errors import InvalidRequestError
from structllm.params import (
    MAX_COUNT,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_TOKEN_ID,
    is_valid_unicode,
)

__all__ = [
    "MAX_CHOICES",
    "MAX_ID_LIST",
    "MAX_MESSAGES",
    "MAX_N",
    "REQUEST_CONFIG",
    "Content",
    "Count",
    "LogitBias",
    "Logprobs",
    "NonEmptyText",
    "Penalty",
    "Prompts",
    "Seed",
    "Stop",
    "Text",
    "TokenId",
    "TopK",
]

MAX_N = 16
#: prompts times n in one completions request
MAX_CHOICES = MAX_N * 8
MAX_STOP = 64
MAX_STOP_LEN = 1024
MAX_MESSAGES = 4096
MAX_ID_LIST = 8192
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1

#: the request models' configuration: strict JSON types, unknown fields
#: ignored (those OpenAI or vLLM define and structllm does not are refused)
REQUEST_CONFIG = ConfigDict(
    strict=True,
    extra="ignore",
    frozen=True,
    allow_inf_nan=False,
    ser_json_inf_nan="null",
    hide_input_in_errors=True,
)


def _unicode(s: str) -> str:
    if not is_valid_unicode(s):
        raise PydanticCustomError(
            "unicode", "must be valid Unicode (it contains a lone surrogate)"
        )
    return s


def _cache_salt(s: str) -> str:
    try:
        check_cache_salt(s)
    except InvalidRequestError as exc:
        raise PydanticCustomError("cache_salt", str(exc)) from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]
CacheSalt = Annotated[str, AfterValidator(_cache_salt)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=UINT64_MAX)]
TopK = Annotated[int, Field(ge=-1, le=MAX_COUNT)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP:
        raise PydanticCustomError(
            "stop", f"must be a string or a list of at most {MAX_STOP} strings"
        )
    for s in items:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LEN:
            raise PydanticCustomError(
                "stop", f"must hold non-empty strings of at most {MAX_STOP_LEN} chars"
            )
        _unicode(s)
    return tuple(items)


Stop = Annotated[
    tuple[str, ...],
    PlainValidator(_stop),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP},
                {"type": "null"},
            ]
        }
    ),
]


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_ID_LIST:
        raise PydanticCustomError(
            "logit_bias", f"must be an object of at most {MAX_ID_LIST} entries"
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12:
            token = int(key)
        if (
            isinstance(token, bool)
            or not isinstance(token, int)
            or not 0 <= token <= MAX_TOKEN_ID
        ):
            raise PydanticCustomError(
                "logit_bias", "keys must be token ids (decimal strings)"
            )
        if (
            isinstance(bias, bool)
            or not isinstance(bias, int | float)
            or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
        ):
            raise PydanticCustomError(
                "logit_bias",
                f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            )
        out[token] = float(bias)
    return out


LogitBias = Annotated[
    dict[int, float],
    PlainValidator(_logit_bias),
    WithJsonSchema(
        {
            "type": "object",
            "additionalProperties": {
                "type": "number",
                "minimum": -MAX_LOGIT_BIAS,
                "maximum": MAX_LOGIT_BIAS,
            },
        }
    ),
]


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """A string, strings, token ids or lists of token ids, none empty."""

    def fail(message: str) -> PydanticCustomError:
        return PydanticCustomError("prompt", message)

    def ids(v: list[Any]) -> tuple[int, ...] | None:
        if not v or not all(_is_token(t) for t in v):
            return None
        if len(v) > MAX_COUNT:
            raise fail("has too many token ids")
        for t in v:
            if not 0 <= t <= MAX_TOKEN_ID:
                raise fail(f"token ids must lie in [0, {MAX_TOKEN_ID}], got {t!r:.60}")
        return tuple(v)

    shape = (
        "must be a non-empty string, a list of strings, a list of token ids "
        "or a list of lists of token ids"
    )
    if isinstance(value, str):
        if not value:
            raise fail("must not be empty")
        return (_unicode(value),)
    if not isinstance(value, list) or not value:
        raise fail(shape)
    if (one := ids(value)) is not None:  # one prompt of token ids
        return (one,)
    if len(value) > MAX_CHOICES:
        raise fail(f"has more than {MAX_CHOICES} prompts")
    if all(isinstance(p, str) for p in value):
        if any(p == "" for p in value):
            raise fail("must not be empty")
        return tuple(_unicode(p) for p in value)
    if all(isinstance(p, list) for p in value):
        out = []
        for p in value:
            if (each := ids(p)) is None:
                raise fail(shape)
            out.append(each)
        return tuple(out)
    raise fail(shape)


_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}}
Prompts = Annotated[
    tuple[str | tuple[int, ...], ...],
    PlainValidator(_prompts),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}},
                _TOKEN_IDS_SCHEMA,
                {"type": "array", "items": _TOKEN_IDS_SCHEMA},
            ]
        }
    ),
]


def _content(value: Any) -> str | None:
    """A string, or OpenAI content parts of type text (joined)."""
    if value is None or isinstance(value, str):
        return None if value is None else _unicode(value)
    if not isinstance(value, list) or len(value) > MAX_MESSAGES:
        raise PydanticCustomError(
            "content", "must be a string or an array of text parts"
        )
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise PydanticCustomError(
                "content",
                "part [{i}] must be an object of type 'text' (only text is supported)",
                {"i": i},
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise PydanticCustomError(
                "content", "part [{i}].text must be a string", {"i": i}
            )
        texts.append(_unicode(text))
    return "".join(texts)


Content = Annotated[
    str | None,
    PlainValidator(_content),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "object"}},
                {"type": "null"},
            ]
        }
    ),
]


def _is_token(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)
