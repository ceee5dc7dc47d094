"""``structllm serve``: the engine and the HTTP server in one structured run.

    async with AsyncLLM.open(...) as llm:      # the engine (its core process)
        await hypercorn serve(app)             # until SIGINT / SIGTERM

On a signal the server drains: the listener stays open and new requests get
503 (``/health`` too), open requests have ``--graceful-timeout`` seconds to
finish, then those still running are cut (a stream with a final error event
and ``[DONE]``); then hypercorn stops, and the engine stops its core process.
Exit status 0, or 1 when the engine had died for good.

The access log (``--access-log``, on by default) goes to stderr, one JSON
line per request (:mod:`~structllm.server.http.access`). API keys come from
``--api-key`` and ``$STRUCTLLM_API_KEY`` together.

The listen backlog is ``--backlog`` (hypercorn would otherwise re-listen
the socket with its own default of 100). Error responses that hypercorn
writes itself (malformed HTTP, 431 for oversized headers) carry an OpenAI
error body too.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import socket
import sys
from typing import Any

import anyio

from structllm.config import (
    EngineConfig,
    FrontendConfig,
    ServerConfig,
    from_arguments,
)
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.errors import EngineConfigError, StructLLMError, unwrap_group
from structllm.server.app import build_app
from structllm.server.http.access import ACCESS_LOGGER
from structllm.server.http.drain import Drain, drain_then_stop
from structllm.server.http.errors import error_json
from structllm.server.http.security import api_keys
from structllm.server.serving import EngineSlot
from structllm.text.tokenizer import Tokenizer

_log = logging.getLogger("structllm.server")

__all__ = [
    "configs_from_args",
    "hypercorn_config",
    "listen",
    "run_server",
    "serve_hypercorn",
]


def configs_from_args(
    ns: argparse.Namespace, engine: EngineConfig
) -> tuple[ServerConfig, FrontendConfig]:
    """The server and front-end configs ``structllm serve``'s flags give."""
    server = from_arguments(
        ServerConfig,
        ns,
        model_name=ns.served_model_name or ns.model,
        api_key=api_keys(ns.api_key, os.environ),
    )
    if server.lora_modules and not engine.enable_lora:
        raise EngineConfigError(
            "--lora-modules loads LoRA adapters: it needs --enable-lora",
            field="lora_modules",
        )
    return server, from_arguments(FrontendConfig, ns)


def run_server(
    server: ServerConfig,
    front: FrontendConfig,
    engine: EngineConfig,
    *,
    tokenizer: Tokenizer | None = None,
) -> int:
    """Serve ``engine.model`` until SIGINT or SIGTERM; the exit status.
    ``tokenizer``: one already loaded (else the engine loads its own)."""
    serve = functools.partial(_serve, tokenizer=tokenizer)
    return anyio.run(serve, server, front, engine, backend=server.loop)


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket (``port`` 0 picks a free one)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


def hypercorn_config(
    sock: socket.socket, *, backlog: int, header_timeout: float
) -> Any:
    """hypercorn's configuration for serving on ``sock``."""
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    # hypercorn calls listen() again on the socket with this value
    config.backlog = backlog
    # our Drain has already cut every request when hypercorn is told to stop
    config.graceful_timeout = 2.0
    # an idle connection (also one still sending its headers) closes after this
    config.keep_alive_timeout = header_timeout
    config.accesslog = None
    config.errorlog = "-"
    _openai_error_bodies()
    return config


async def _serve(
    server: ServerConfig,
    front: FrontendConfig,
    engine: EngineConfig,
    *,
    tokenizer: Tokenizer | None,
) -> int:
    sock = listen(server.host, server.port, server.backlog)
    port = sock.getsockname()[1]
    config = hypercorn_config(
        sock, backlog=server.backlog, header_timeout=server.header_timeout
    )
    name = server.model_name
    shutdown = anyio.Event()
    slot = EngineSlot()
    drain = Drain(retry_after=server.retry_after)
    if server.access_log:
        _log_access_to_stderr()
    app = build_app(slot, server, drain)
    status = 0
    try:
        async with anyio.create_task_group() as tg:
            # listen from the start: /health answers 503 while the model loads
            served = anyio.Event()

            async def serve_http() -> None:
                try:
                    await serve_hypercorn(app, config, shutdown)
                finally:
                    served.set()

            tg.start_soon(serve_http)
            tg.start_soon(_on_signals, drain, server.graceful_timeout, shutdown)
            print(f"structllm: listening on http://{server.host}:{port}", flush=True)
            try:
                async with AsyncLLM.from_config(
                    engine, front, tokenizer=tokenizer
                ) as llm:
                    if slot.loras is not None:  # --lora-modules, before any request
                        await slot.loras.load_modules(llm, server.lora_modules)
                    slot.llm = llm
                    tg.start_soon(_watch_engine, llm, shutdown)
                    print(
                        f"structllm: serving {name!r} on http://{server.host}:{port}",
                        flush=True,
                    )
                    # hypercorn returns once shutdown is set and open requests drained
                    await served.wait()
                    status = 1 if llm.statistics().dead else 0
                    slot.llm = None
            except StructLLMError as exc:
                print(f"structllm: the engine failed to start: {exc}", file=sys.stderr)
                status = 1
                shutdown.set()
            # hypercorn closes its open connections (clients polling /health
            # while the model loaded) itself; cancelling it mid-way would
            # leave its asyncio tasks to log tracebacks
            with anyio.move_on_after(config.graceful_timeout + 1.0):
                await served.wait()
            tg.cancel_scope.cancel()
    finally:
        if sock.fileno() != -1:
            with contextlib.suppress(OSError):  # hypercorn may have closed it
                sock.close()
    print("structllm: stopped" + (" (the engine died)" if status else ""), flush=True)
    return status


def _log_access_to_stderr() -> None:
    """The access log's lines on stderr, one each, without a prefix."""
    log = logging.getLogger(ACCESS_LOGGER)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


async def serve_hypercorn(app: Any, config: Any, shutdown: anyio.Event) -> None:
    """Serve ``app`` on hypercorn under the running loop until ``shutdown``."""
    import sniffio

    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve as trio_serve

        _trio_connections_fail_alone()
        await trio_serve(app, config, shutdown_trigger=shutdown.wait)
    else:
        from hypercorn.asyncio import serve as asyncio_serve

        await asyncio_serve(app, config, shutdown_trigger=shutdown.wait)


async def _on_signals(drain: Drain, grace: float, shutdown: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            print(
                f"structllm: {signal.Signals(signum).name}, shutting down",
                file=sys.stderr,
            )
            await drain_then_stop(drain, grace, shutdown)
            return


def _openai_error_bodies() -> None:
    """Make hypercorn's own HTTP-level errors (400, 431, ...) OpenAI-shaped.

    hypercorn answers a request h11 cannot parse with an empty body from
    ``H11Protocol._send_error_response``; there is no hook for it, so that
    one method is replaced (checked by tests/test_api_boundary.py).

    The response goes out as one write. Sent event by event, as hypercorn
    does, the write of the head is a checkpoint under trio, and the app may
    answer the request h11 did parse meanwhile (an HTTP/1.0 POST without
    Content-Length has an empty body; the bytes after it are the error):
    h11 refuses the app's response and that moves our side to ERROR, so the
    error's body was never sent (its Content-Length promised, 0 bytes
    written; tests/test_http10.py). asyncio's writes do not yield, which
    is why only trio lost it.
    """
    from itertools import chain

    import h11
    from hypercorn.events import RawData
    from hypercorn.protocol.h11 import H11Protocol

    if getattr(H11Protocol, "_structllm_bodies", False):
        return

    async def send_error_response(self: Any, status_code: int) -> None:
        reason = {400: "malformed HTTP request", 431: "request headers too large"}
        body = error_json(status_code, reason.get(status_code, "HTTP error"))
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        events = [
            h11.Response(
                status_code=status_code,
                headers=list(chain(headers, self.config.response_headers("h11"))),
            ),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ]
        try:
            data = b"".join(self.connection.send(e) or b"" for e in events)
        except h11.LocalProtocolError:
            return  # a response had already started: nothing more to say
        await self.send(RawData(data=data))

    H11Protocol._send_error_response = send_error_response  # type: ignore[method-assign]
    H11Protocol._structllm_bodies = True  # type: ignore[attr-defined]


def _trio_connections_fail_alone() -> None:
    """Under trio, an error in one connection must not stop the server.

    hypercorn's trio worker runs each connection in the listeners' nursery
    and lets any exception but ``OSError`` out of it, which ends the whole
    server. One does escape: a client that hangs up in the middle of its
    body makes hypercorn write an error response while the same connection
    is being closed (``send_eof`` outside its send lock), and trio raises
    ``BusyResourceError`` (found by tools/soak.py; asyncio's worker runs
    connections as separate tasks and is not affected). The connection is
    gone either way; log it and let the server serve on.
    """
    from hypercorn.trio.tcp_server import TCPServer

    if getattr(TCPServer, "_structllm_fail_alone", False):
        return
    run = TCPServer.run

    async def run_alone(self: Any) -> None:
        try:
            await run(self)
        except Exception as exc:  # Cancelled is a BaseException: not caught
            _log.warning("a connection failed (%s); the server serves on", _leaf(exc))

    TCPServer.run = run_alone  # type: ignore[method-assign]
    TCPServer._structllm_fail_alone = True  # type: ignore[attr-defined]


def _leaf(exc: BaseException) -> str:
    exc = unwrap_group(exc)
    return f"{type(exc).__name__}: {exc}"


async def _watch_engine(llm: AsyncLLM, shutdown: anyio.Event) -> None:
    """Stop serving once the engine has died for good (exit status 1)."""
    await llm.wait_dead()
    print("structllm: the engine died for good, shutting down", file=sys.stderr)
    shutdown.set()
