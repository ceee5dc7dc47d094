"""Request bodies: read under a size cap, parsed as strict JSON, validated.

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
from fastapi import Request
from pydantic import BaseModel, ValidationError

from structllm.server.protocol import validation_error

__all__ = [
    "BIG_BODY",
    "BodyTooLargeError",
    "maybe_off_loop",
    "parse_json",
    "read_body",
    "validate",
]

#: bodies larger than this are parsed and validated in a worker thread
BIG_BODY = 256 << 10

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)


class BodyTooLargeError(Exception):
    """The body is larger than the server accepts (413)."""


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
