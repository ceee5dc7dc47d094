"""Who may call the server: API keys and CORS.

:class:`ApiKeyMiddleware` requires ``Authorization: Bearer KEY`` or
Anthropic's ``x-api-key: KEY`` (either one valid is enough, on every route,
as llama.cpp accepts both) on the ``/v1`` routes, ``/tokenize``,
``/detokenize`` and ``/tokenizer_info``, llama.cpp's native routes and
``/v1``-less aliases (``/completion``, ``/props``, ``/models``...), Ollama's
``/api/`` routes (and ``/metrics`` with ``--metrics-require-auth``) once any
``--api-key`` is configured; ``/health``, ``/version`` and ``/api/version``
stay open. Each given key is hashed and compared with
``hmac.compare_digest`` against the hash of every configured key, all of
them, so neither the time taken nor an early exit tells which key, or which
prefix or length, came close. A refusal is a 401 with an OpenAI error body
(Anthropic's on ``/v1/messages``) and ``WWW-Authenticate: Bearer``; neither
the key given nor any configured one appears in it. :func:`api_keys` reads
the keys from the flags and from
``STRUCTLLM_API_KEY``.

:func:`add_cors` installs Starlette's ``CORSMiddleware`` only when
``--allowed-origins`` are given: without them the server sends no CORS
headers at all, so browsers keep the same-origin rule.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from structllm.config import ServerConfig
from structllm.server.http.errors import anthropic_path, json_error, send_error

__all__ = ["API_KEY_ENV", "ApiKeyMiddleware", "add_cors", "api_keys"]

#: the environment variable holding API keys (comma-separated)
API_KEY_ENV = "STRUCTLLM_API_KEY"

#: routes under the key besides everything below /v1 and Ollama's /api
_PROTECTED = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        # llama.cpp's native routes and its aliases of the /v1 ones
        "/completion",
        "/completions",
        "/chat/completions",
        "/models",
        "/props",
        "/slots",
        "/apply-template",
    }
)
#: Ollama's routes that stay open (as /version does)
_OPEN = frozenset({"/api/version"})


def api_keys(flags: Iterable[str], environ: Mapping[str, str]) -> tuple[str, ...]:
    """The keys of ``--api-key`` and of ``$STRUCTLLM_API_KEY``, once each."""
    from_env = [k.strip() for k in environ.get(API_KEY_ENV, "").split(",")]
    return tuple(dict.fromkeys([*flags, *(k for k in from_env if k)]))


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeyMiddleware:
    """401 without a configured key on the protected routes."""

    def __init__(
        self, app: ASGIApp, *, keys: Iterable[str], metrics_require_auth: bool
    ) -> None:
        self._app = app
        self._digests = tuple(_digest(k.encode()) for k in keys)
        self._metrics = metrics_require_auth
        if not self._digests:
            raise ValueError("ApiKeyMiddleware needs at least one key")

    def protects(self, path: str) -> bool:
        return (
            path == "/v1"
            or path.startswith("/v1/")
            or path in _PROTECTED
            or (path.startswith("/api/") and path not in _OPEN)
            or (self._metrics and path == "/metrics")
        )

    def authorized(self, header: bytes | None) -> bool:
        """True when ``header`` is ``Bearer`` and one of the keys, in constant time."""
        if header is None:
            return False
        scheme, _, token = header.strip().partition(b" ")
        return self._known(token) and scheme.lower() == b"bearer"

    def _known(self, key: bytes | None) -> bool:
        """True when ``key`` is one of the keys, in constant time."""
        if key is None:
            return False
        given = _digest(key.strip())
        match = False
        for digest in self._digests:  # every key, whatever matched before
            match |= hmac.compare_digest(given, digest)
        return match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if scope["type"] != "http" or not self.protects(path):
            await self._app(scope, receive, send)
            return
        bearer = self.authorized(_header(scope, b"authorization"))
        x_api_key = self._known(_header(scope, b"x-api-key"))
        if bearer or x_api_key:
            await self._app(scope, receive, send)
            return
        await send_error(
            send,
            401,
            "a valid API key is required: send the header 'Authorization: "
            "Bearer <key>' or 'x-api-key: <key>'",
            {"www-authenticate": "Bearer"},
            anthropic=anthropic_path(path),
        )


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The first header ``name`` (ASGI names are lower-case), if any."""
    return next((v for k, v in scope["headers"] if k == name), None)


class _CORS(CORSMiddleware):
    """Starlette's CORS, with an OpenAI error body on a refused preflight."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        keep = {
            k: v
            for k, v in response.headers.items()
            if k not in ("content-length", "content-type")
        }
        message = bytes(response.body).decode()
        return json_error(response.status_code, message, headers=keep)


def add_cors(app: FastAPI, config: ServerConfig) -> None:
    """CORS for ``--allowed-origins``; nothing at all without them."""
    if not config.allowed_origins:
        return
    app.add_middleware(
        _CORS,
        allow_origins=list(config.allowed_origins),
        allow_methods=list(config.allowed_methods),
        allow_headers=list(config.allowed_headers),
        allow_credentials=config.allow_credentials,
        expose_headers=["X-Request-Id"],
    )
