"""Request bodies: read under a size cap, parsed as strict JSON, validated.

``receive_json`` is the whole intake an endpoint starts with: a body
declared as anything but JSON is a 415, one over the cap a 413, one not
received within the body timeout a 408, and one that does not parse a 400,
each an OpenAI error body; otherwise the parsed value.
``read_body`` refuses more than the cap (413) before or while reading;
``parse_json`` refuses NaN and Infinity (and raises ``RecursionError`` on
nesting too deep); ``validate`` turns a pydantic failure into an
``InvalidRequestError`` naming the field. Bodies over :data:`BIG_BODY` are
parsed and validated in a worker thread (``maybe_off_loop``), so the event
loop stays responsive.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import attrs
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from structllm.server.http.errors import json_error
from structllm.server.protocol.validation import validation_error

__all__ = [
    "BIG_BODY",
    "Body",
    "BodyTooLargeError",
    "maybe_off_loop",
    "parse_json",
    "read_body",
    "receive_json",
    "validate",
]

#: bodies larger than this are parsed and validated in a worker thread
BIG_BODY = 256 << 10

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)


class BodyTooLargeError(Exception):
    """The body is larger than the server accepts (413)."""


@attrs.frozen
class Body:
    """A parsed request body; ``big`` when it is over :data:`BIG_BODY` bytes."""

    value: Any
    big: bool


async def receive_json(
    request: Request, limit: int, body_timeout: float
) -> Body | Response:
    """The body as parsed JSON, or the error response that refuses it.

    A client that hangs up meanwhile gets a bare 499 (nobody reads it).
    """
    media_type = request.headers.get("content-type", "").split(";")[0].strip()
    if media_type and not _is_json(media_type.lower()):
        return json_error(
            415,
            f"the body must be JSON (Content-Type: application/json), "
            f"not {media_type[:100]!r}",
            param="Content-Type",
            headers={"connection": "close"},
        )
    try:
        with anyio.fail_after(body_timeout):
            raw = await read_body(request, limit)
    except ClientDisconnect:
        return Response(status_code=499)
    except BodyTooLargeError:
        return json_error(
            413,
            f"the request body exceeds {limit} bytes",
            headers={"connection": "close"},
        )
    except TimeoutError:
        return json_error(
            408,
            f"the request body was not received within {body_timeout:g}s",
            headers={"connection": "close"},
        )
    big = len(raw) > BIG_BODY
    try:
        return Body(await maybe_off_loop(big, parse_json, raw), big)
    except (ValueError, RecursionError) as exc:
        return json_error(400, f"the body is not valid JSON: {exc}"[:500])


def _is_json(media_type: str) -> bool:
    """application/json or a ``+json`` type; a body without one is read as JSON."""
    return media_type == "application/json" or media_type.endswith("+json")


async def maybe_off_loop(big: bool, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, in a worker thread when ``big`` (the loop stays responsive).

    Cancelled meanwhile, it waits for the thread (CPU work bounded by the
    body cap) and then raises; the thread's result is dropped.
    """
    if not big:
        return fn(*args)
    result = await anyio.to_thread.run_sync(fn, *args)
    await anyio.lowlevel.checkpoint_if_cancelled()
    return result


def validate(model: type[_M], body: Any) -> _M:
    """``body`` as a ``model``; InvalidRequestError naming the field if not."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing more than ``limit`` bytes (run it under a deadline)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> Any:
    return json.loads(raw, parse_constant=_reject_constant)
