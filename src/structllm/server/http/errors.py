"""Errors to HTTP: an OpenAI error body for every status the server sends.

:func:`error_response` maps the errors of :mod:`structllm.errors` (and the
server's own two) to a status; :func:`install_handlers` makes Starlette's
404, 405 and validation errors, and any unexpected exception, OpenAI-shaped
too. Bodies are ASCII-only JSON, so rendering one can never fail.

Anthropic's Messages routes (:func:`anthropic_path`) answer in Anthropic's
shape instead (``{"type": "error", "error": {"type":
"invalid_request_error", "message": ...}}``), whoever answers:
:func:`anthropic_error_json` writes it; the middlewares (auth, limits,
drain, access) pass ``anthropic=`` to :func:`send_error`, the app's
handlers answer through :func:`path_error`, and
:mod:`~structllm.server.messages.serving` rewrites its own errors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from structllm.errors import (
    EngineDeadError,
    EngineLoadingError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
    ShuttingDownError,
)
from structllm.server.protocol.bodies import error_body

__all__ = [
    "ANTHROPIC_ERROR_TYPES",
    "ASCIIJSONResponse",
    "ModelNotFoundError",
    "RequestTimeoutError",
    "anthropic_error_json",
    "anthropic_path",
    "error_json",
    "error_response",
    "install_handlers",
    "json_error",
    "path_error",
    "send_error",
]

_STATUS_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "BadRequestError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


#: Anthropic's error types by status (other 4xx: invalid_request_error)
ANTHROPIC_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class ModelNotFoundError(Exception):
    """The request names a model this server does not serve (404)."""


class RequestTimeoutError(Exception):
    """The request ran longer than ``--request-timeout`` (408)."""

    def __init__(self, seconds: float | None = None) -> None:
        super().__init__(f"the request took longer than {seconds or 0:g}s")


def error_json(status: int, message: str, param: str | None = None) -> bytes:
    """An OpenAI error body, ASCII-only (so no string can fail to encode)."""
    body = error_body(
        message,
        type_=_STATUS_TYPES.get(status, "APIError"),
        param=param,
        code=status,
    )
    return json.dumps(body, ensure_ascii=True).encode()


def anthropic_path(path: str) -> bool:
    """Whether ``path`` is one of Anthropic's routes (its errors are Anthropic's)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_json(status: int, message: str) -> bytes:
    """An Anthropic error body, ASCII-only."""
    default = "invalid_request_error" if status < 500 else "api_error"
    kind = ANTHROPIC_ERROR_TYPES.get(status, default)
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return json.dumps(body, ensure_ascii=True).encode()


class ASCIIJSONResponse(JSONResponse):
    """JSONResponse that escapes non-ASCII: rendering can never raise."""

    def render(self, content: Any) -> bytes:
        return json.dumps(
            content, ensure_ascii=True, allow_nan=False, separators=(",", ":")
        ).encode()


def json_error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    return Response(
        error_json(status, message, param),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


def path_error(
    path: str,
    status: int,
    message: str,
    *,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """An error response for a request to ``path``: Anthropic's shape on its
    routes, OpenAI's elsewhere."""
    if not anthropic_path(path):
        return json_error(status, message, headers=headers)
    return Response(
        anthropic_error_json(status, message),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


def error_response(exc: BaseException, *, retry_after: int) -> Response | None:
    """The response for a known error, or None for one that is a bug."""
    if isinstance(exc, InvalidRequestError):
        return json_error(400, str(exc), param=exc.field)
    if isinstance(exc, ModelNotFoundError):
        return json_error(404, str(exc), param="model")
    if isinstance(exc, EngineOverloadedError | EngineLoadingError | ShuttingDownError):
        return json_error(503, str(exc), headers={"Retry-After": str(retry_after)})
    if isinstance(exc, EngineDeadError):
        return json_error(503, f"the engine is unavailable: {exc}")
    if isinstance(exc, RequestTimeoutError):
        return json_error(408, str(exc))
    if isinstance(exc, RequestFailedError):
        return json_error(500, str(exc))
    return None


async def send_error(
    send: Send,
    status: int,
    message: str,
    headers: dict[str, str] | None = None,
    *,
    anthropic: bool = False,
) -> None:
    """Send a whole error response on a raw ASGI ``send`` (in Anthropic's
    shape when ``anthropic``)."""
    body = (
        anthropic_error_json(status, message)
        if anthropic
        else error_json(status, message)
    )
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.encode(), v.encode()) for k, v in (headers or {}).items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def install_handlers(app: FastAPI) -> None:
    """404, 405, FastAPI's own validation errors and bugs: OpenAI bodies
    (Anthropic's on its routes)."""

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.url.path!r}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path!r}"
        return path_error(
            request.url.path, exc.status_code, message, headers=exc.headers
        )

    async def invalid(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message = f"invalid request: {exc.errors()[:1]}"
        return path_error(request.url.path, 400, message)

    async def internal(request: Request, exc: Exception) -> Response:
        message = f"internal error: {type(exc).__name__}"
        return path_error(request.url.path, 500, message)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(Exception, internal)
