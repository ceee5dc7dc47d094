"""Pydantic failures as :class:`~structllm.errors.InvalidRequestError`.

:func:`validation_error` takes the first error of a ``ValidationError`` and
names its field by path (``messages[0].content``, ``tools[1].function.name``):
union members' tags (``str``, ``list[...]``, ``[function]``) are left out,
and a custom error of type ``"refused"`` or ``"field"`` names the field in
its context (``{"name": ...}``) below the path where it was raised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from structllm.errors import InvalidRequestError

__all__ = ["validation_error"]


def validation_error(exc: ValidationError) -> InvalidRequestError:
    """The first error of ``exc`` as an InvalidRequestError naming its path."""
    err = exc.errors(include_url=False, include_input=False)[0]
    param = _param(err["loc"], err["type"], err.get("ctx"))
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if param is None:
        return InvalidRequestError(message, field=None)
    return InvalidRequestError(f"{param}: {message}", field=param)


def _param(
    loc: Sequence[int | str], kind: str, ctx: Mapping[str, Any] | None
) -> str | None:
    if kind in ("refused", "field") and ctx:
        prefix, name = _path(loc), str(ctx["name"])
        return f"{prefix}.{name}" if prefix and name else (prefix or name or None)
    if kind in ("stream_options", "best_of", "top_logprobs") and not loc:
        return kind
    if kind == "prompt" and not loc:
        return "prompt"
    return _path(loc) or None


def _path(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "str" or "[" in part:
            continue  # a union member's tag (str, list[...]), not a field
        else:
            out += f".{part}" if out else part
    return out
