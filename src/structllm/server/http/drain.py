"""Graceful shutdown of the generating routes: :class:`Drain` and its middleware.

The routes drained are those under ``/v1/`` and the other APIs' generating
routes (:data:`GENERATING`: llama.cpp's ``/completion``, Ollama's
``/api/chat``...). ``start()``: new requests get 503, the listener stays
open. ``cut()``: requests still running are cancelled; one that already
sent its 200 gets a final error event and ``[DONE]`` (an NDJSON stream: a
last ``{"error": ...}`` line; a Messages stream: Anthropic's ``error``
event), one that did not gets a 503. On Anthropic's routes every error is
in Anthropic's shape.
:func:`drain_then_stop` is the whole sequence ``structllm serve`` runs on
SIGINT or SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import anyio
import attrs
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from structllm.server.http.errors import (
    anthropic_error_json,
    anthropic_path,
    error_json,
    send_error,
)

__all__ = ["GENERATING", "Drain", "DrainMiddleware", "drain_then_stop", "drains"]

#: routes outside ``/v1/`` that generate: llama.cpp's native ones and its
#: ``/v1``-less alias of chat, and Ollama's
GENERATING = frozenset(
    {"/completion", "/completions", "/chat/completions", "/api/generate", "/api/chat"}
)


def drains(path: str) -> bool:
    """Whether a request to ``path`` is refused and cut by a drain."""
    return path.startswith("/v1/") or path in GENERATING


@attrs.define(eq=False)
class Drain:
    """Graceful shutdown of the generating routes (an ASGI middleware's state).

    ``start()``: new requests get 503, the listener stays open. ``cut()``:
    requests still running are cancelled; one that already sent its 200
    gets a final error event and ``[DONE]``, one that did not gets a 503.
    """

    retry_after: int = 1
    draining: bool = False
    cutting: bool = False
    _scopes: set[anyio.CancelScope] = attrs.Factory(set)
    _idle: anyio.Event | None = None

    @property
    def active(self) -> int:
        return len(self._scopes)

    def start(self) -> None:
        self.draining = True

    def cut(self) -> None:
        self.cutting = True
        for scope in list(self._scopes):
            scope.cancel()

    async def wait_idle(self) -> None:
        while self._scopes:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    @contextlib.contextmanager
    def _register(self) -> Iterator[anyio.CancelScope]:
        scope = anyio.CancelScope()
        self._scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._scopes.discard(scope)
            if not self._scopes and self._idle is not None:
                self._idle.set()
                self._idle = None

    def middleware(self, app: ASGIApp) -> ASGIApp:
        async def drained(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or not drains(scope["path"]):
                await app(scope, receive, send)
                return
            anthropic = anthropic_path(scope["path"])
            if self.draining:
                await send_error(
                    send,
                    503,
                    "the server is shutting down",
                    {"retry-after": str(self.retry_after), "connection": "close"},
                    anthropic=anthropic,
                )
                return
            started: dict[str, Any] = {}
            finished = False

            async def tracked(message: Message) -> None:
                nonlocal finished
                if message["type"] == "http.response.start":
                    started.update(message)
                elif message["type"] == "http.response.body" and not message.get(
                    "more_body", False
                ):
                    finished = True
                await send(message)

            with self._register() as cancel:
                await app(scope, receive, tracked)
            if not cancel.cancelled_caught or finished:
                return
            with contextlib.suppress(OSError, RuntimeError):
                message = "the server shut down before the response finished"
                if not started:
                    await send_error(
                        send, 503, "the server is shutting down", anthropic=anthropic
                    )
                elif _content_type(started).startswith(b"application/x-ndjson"):
                    line = json.dumps({"error": message}) + "\n"
                    await send(
                        {
                            "type": "http.response.body",
                            "body": line.encode(),
                            "more_body": False,
                        }
                    )
                elif _content_type(started).startswith(b"text/event-stream"):
                    await send(
                        {
                            "type": "http.response.body",
                            "body": _last_event(message, anthropic=anthropic),
                            "more_body": False,
                        }
                    )
                else:
                    await send(
                        {"type": "http.response.body", "body": b"", "more_body": False}
                    )

        return drained


def _last_event(message: str, *, anthropic: bool) -> bytes:
    """The event that ends a stream cut short: an OpenAI error and ``[DONE]``,
    or Anthropic's ``error`` event (its streams have no ``[DONE]``)."""
    if anthropic:
        body = anthropic_error_json(503, message).decode()
        return f"event: error\ndata: {body}\n\n".encode()
    return f"data: {error_json(503, message).decode()}\n\ndata: [DONE]\n\n".encode()


def _content_type(start: dict[str, Any]) -> bytes:
    for k, v in start.get("headers", []):
        if k.lower() == b"content-type":
            return bytes(v)
    return b""


class DrainMiddleware:
    """Starlette-style middleware class around :meth:`Drain.middleware`."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self._app = drain.middleware(app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


async def drain_then_stop(drain: Drain, grace: float, shutdown: anyio.Event) -> None:
    """503 for new requests, ``grace`` seconds for open ones, cut the rest, stop."""
    drain.start()
    with anyio.move_on_after(grace):
        await drain.wait_idle()
    drain.cut()
    with anyio.move_on_after(5.0):  # cut requests write their last event
        await drain.wait_idle()
    shutdown.set()
