"""A bound on the requests the server handles at once, overall and per client.

hypercorn has no such setting (its ``max_requests`` restarts workers and
``keep_alive_max_requests`` counts requests on one connection), so the
bound is an ASGI middleware: :class:`ConcurrencyLimit` counts the requests
in the app, from their headers to the end of their response (a stream
until its ``[DONE]``), and answers a request beyond
``--max-concurrent-requests``, or beyond
``--max-concurrent-requests-per-client`` for its peer address, with 503 and
``Retry-After`` before reading its body (Anthropic's error shape on its
routes). ``/health`` and ``/metrics`` are
never refused, so monitoring sees a full server. Connections without a
request in flight are bounded in time, not number: ``--header-timeout``
closes one idle or still sending its headers.

Behind a proxy every request has the proxy's address: the per-client bound
is then a second overall bound.
"""

from __future__ import annotations

import attrs
from starlette.types import ASGIApp, Receive, Scope, Send

from structllm.server.http.errors import anthropic_path, send_error

__all__ = ["ConcurrencyLimit", "LimitState"]

_EXEMPT = frozenset({"/health", "/metrics"})


@attrs.define(eq=False)
class LimitState:
    """The counts (one event loop: no lock needed)."""

    total: int | None
    per_client: int | None
    active: int = 0
    by_client: dict[str, int] = attrs.Factory(dict)
    refused: int = 0

    def refusal(self, client: str) -> str | None:
        """Why a new request from ``client`` is refused, or None to admit it."""
        if self.total is not None and self.active >= self.total:
            return f"the server is handling its limit of {self.total} requests"
        if self.per_client is not None and self.by_client.get(client, 0) >= (
            self.per_client
        ):
            return f"this client has its limit of {self.per_client} requests in flight"
        return None

    def enter(self, client: str) -> None:
        self.active += 1
        self.by_client[client] = self.by_client.get(client, 0) + 1

    def leave(self, client: str) -> None:
        self.active -= 1
        left = self.by_client[client] - 1
        if left:
            self.by_client[client] = left
        else:
            del self.by_client[client]


class ConcurrencyLimit:
    """503 with ``Retry-After`` for requests beyond the limits."""

    def __init__(self, app: ASGIApp, *, state: LimitState, retry_after: int) -> None:
        self._app = app
        self._state = state
        self._retry_after = str(retry_after)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _EXEMPT:
            await self._app(scope, receive, send)
            return
        state = self._state
        peer = scope.get("client")
        client = peer[0] if peer else ""
        reason = state.refusal(client)
        if reason is not None:
            state.refused += 1
            await send_error(
                send,
                503,
                reason,
                {"retry-after": self._retry_after},
                anthropic=anthropic_path(scope["path"]),
            )
            return
        state.enter(client)
        try:
            await self._app(scope, receive, send)
        finally:
            state.leave(client)
