"""Request ids and the access log: what the server records of every request.

:class:`RequestContextMiddleware` is the outermost layer of the app. For
each HTTP request it

- takes the ``X-Request-Id`` header when it is a sane id (1 to
  :data:`MAX_REQUEST_ID` printable ASCII characters, no spaces) and
  otherwise makes one, and echoes it on the response, whatever the status
  (401, 503, 500 and streams included);
- makes a :class:`RequestRecord` that the serving code reaches through
  :func:`current_record` (a context variable, so tasks the request starts
  see it too): it names the engine requests after the id
  (:meth:`RequestRecord.engine_request_id`) and counts tokens, the first
  token's time and the finish reasons;
- writes one JSON line per request on the ``structllm.access`` logger:
  ``request_id, method, path, status, prompt_tokens, completion_tokens,
  ttft_s, e2e_s, finish_reason`` (and ``prompt``, its first
  ``--max-log-len`` characters, only when that is above 0). Headers are
  never logged. When the logger is not enabled for INFO nothing is built.
"""

from __future__ import annotations

import contextvars
import itertools
import json
import logging
import time
import uuid
from typing import Any

import attrs
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from structllm.errors import unwrap_group
from structllm.server.http.errors import anthropic_path, send_error

__all__ = [
    "ACCESS_LOGGER",
    "MAX_REQUEST_ID",
    "RequestContextMiddleware",
    "RequestRecord",
    "current_record",
    "valid_request_id",
]

#: the access log's logger name
ACCESS_LOGGER = "structllm.access"
#: the longest ``X-Request-Id`` taken from a client
MAX_REQUEST_ID = 128

_access = logging.getLogger(ACCESS_LOGGER)
_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "structllm_request", default=None
)


def current_record() -> RequestRecord | None:
    """The record of the HTTP request being served (None outside one)."""
    return _current.get()


def valid_request_id(value: bytes) -> bool:
    """1 to 128 visible ASCII characters (``!`` to ``~``)."""
    return 0 < len(value) <= MAX_REQUEST_ID and all(33 <= b <= 126 for b in value)


@attrs.define(eq=False)
class RequestRecord:
    """What one HTTP request did; its serving code fills in the engine part."""

    request_id: str
    #: per server, so two requests given the same id still name distinct
    #: engine requests
    serial: int
    method: str
    path: str
    #: characters of the prompt to keep for the log (0: none)
    prompt_chars: int = 0
    start: float = attrs.field(factory=time.monotonic)
    status: int | None = None
    prompt_tokens: dict[int, int] = attrs.Factory(dict)
    completion_tokens: int = 0
    first_token: float | None = None
    finish_reasons: dict[int, str] = attrs.Factory(dict)
    prompt: str | None = None

    def engine_request_id(self, index: int) -> str:
        """The engine request id of choice ``index``: unique per choice."""
        return f"{self.request_id}-{self.serial}-{index}"

    def token(self) -> None:
        """An output arrived (the first one sets the time to first token)."""
        if self.first_token is None:
            self.first_token = time.monotonic()

    def finished(
        self,
        index: int,
        prompt_index: int,
        prompt_tokens: int,
        completion_tokens: int,
        reason: str | None,
    ) -> None:
        """Choice ``index`` (of prompt ``prompt_index``) is done."""
        self.prompt_tokens[prompt_index] = prompt_tokens
        self.completion_tokens += completion_tokens
        self.finish_reasons[index] = str(reason)

    def line(self) -> str:
        """The access-log line: one JSON object."""
        end = time.monotonic()
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "prompt_tokens": sum(self.prompt_tokens.values()),
            "completion_tokens": self.completion_tokens,
            "ttft_s": None
            if self.first_token is None
            else round(self.first_token - self.start, 4),
            "e2e_s": round(end - self.start, 4),
            "finish_reason": ",".join(
                self.finish_reasons[i] for i in sorted(self.finish_reasons)
            )
            or None,
        }
        if self.prompt is not None:
            fields["prompt"] = self.prompt
        return json.dumps(fields, ensure_ascii=True)


class RequestContextMiddleware:
    """Request id in, request id out, one access-log line (the outermost layer)."""

    def __init__(self, app: ASGIApp, *, access_log: bool, max_log_len: int) -> None:
        self._app = app
        self._log = access_log
        self._max_log_len = max_log_len
        self._serials = itertools.count()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        rid = given.decode() if valid_request_id(given) else uuid.uuid4().hex
        record = RequestRecord(
            rid,
            next(self._serials),
            scope["method"],
            scope["path"],
            prompt_chars=self._max_log_len if self._log else 0,
        )
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        token = _current.set(record)
        try:
            await self._app(scope, receive, send_with_id)
        except Exception as exc:
            # Starlette's outer error middleware would answer with the send
            # it was given, without the id: answer here, it sees it started
            if record.status is None:
                name = type(unwrap_group(exc)).__name__
                await send_error(
                    send_with_id,
                    500,
                    f"internal error: {name}",
                    anthropic=anthropic_path(scope["path"]),
                )
            raise
        finally:
            _current.reset(token)
            if self._log and _access.isEnabledFor(logging.INFO):
                _access.info(record.line())
