"""The pieces of a request's lifetime that watch the clock and the client.

:class:`EventStream` is a server-sent-events response that owns a watcher
for ``http.disconnect`` (Starlette's ``StreamingResponse`` may only notice a
disconnect at its next write): when the client leaves, the producer is
cancelled, its ``stream`` block exits and the engine aborts the request. Its
events may be named (``event:`` lines, as Anthropic's and the Responses
API's streams are).
:func:`cancel_on_disconnect` is that watcher, used for non-streaming
requests as well. :class:`NDJSONStream` is the same with one JSON object a
line (Ollama's streams). :class:`deadline` is ``fail_after`` raising
:class:`~structllm.server.http.errors.RequestTimeoutError`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from structllm.server.http.errors import RequestTimeoutError

__all__ = ["Emit", "EventStream", "NDJSONStream", "cancel_on_disconnect", "deadline"]

#: sends one ``data:`` event: a JSON object, or a bare string (``[DONE]``)
Emit = Callable[[dict[str, Any] | str], Awaitable[None]]


class EventStream(Response):
    """Server-sent events from ``produce(emit)``, cancelled if the client leaves.

    ``named``: each JSON event also has an ``event:`` line, its ``type``, as
    the streams of Anthropic's Messages and OpenAI's Responses APIs do (the
    ``anthropic`` client skips events without one).
    """

    media_type = "text/event-stream"

    def __init__(
        self, produce: Callable[[Emit], Awaitable[None]], *, named: bool = False
    ) -> None:
        super().__init__(status_code=200, media_type=self.media_type)
        self._produce = produce
        self._named = named

    @staticmethod
    def frame(data: str, name: str | None = None) -> bytes:
        """One event on the wire."""
        if name is None:
            return f"data: {data}\n\n".encode()
        return f"event: {name}\ndata: {data}\n\n".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", f"{self.media_type}; charset=utf-8".encode()),
                    (b"cache-control", b"no-cache"),
                ],
            }
        )

        async def emit(event: dict[str, Any] | str) -> None:
            data = event if isinstance(event, str) else json.dumps(event)
            name = None
            if self._named and isinstance(event, dict):
                name = str(event["type"])
            await send(
                {
                    "type": "http.response.body",
                    "body": self.frame(data, name),
                    "more_body": True,
                }
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_disconnect, receive, tg.cancel_scope)
            await self._produce(emit)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            tg.cancel_scope.cancel()


class NDJSONStream(EventStream):
    """Newline-delimited JSON from ``produce(emit)``: one object a line."""

    media_type = "application/x-ndjson"

    @staticmethod
    def frame(data: str, name: str | None = None) -> bytes:
        return f"{data}\n".encode()


async def cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` when the client disconnects (the body is already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


class deadline:
    """``fail_after(seconds)`` raising RequestTimeoutError; None means never."""

    def __init__(self, seconds: float | None) -> None:
        self._seconds = seconds
        self._scope = anyio.CancelScope(
            deadline=math.inf if seconds is None else anyio.current_time() + seconds
        )

    def __enter__(self) -> anyio.CancelScope:
        return self._scope.__enter__()

    def __exit__(self, *exc: Any) -> bool:
        swallowed = self._scope.__exit__(*exc)
        deadline = self._scope.deadline
        if (
            self._scope.cancelled_caught
            and anyio.current_time() >= deadline != math.inf
        ):
            raise RequestTimeoutError(self._seconds)
        return bool(swallowed)
