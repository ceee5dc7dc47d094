"""``structllm serve``: the engine and the HTTP server in one structured run.

    async with AsyncLLM.open(...) as llm:      # the engine (worker process)
        await hypercorn serve(app)             # until SIGINT / SIGTERM

On a signal the server stops accepting, lets open requests finish for
``--graceful-timeout`` seconds, then the engine drains for its shutdown
grace and stops its worker. Exit status 0, or 1 when the engine had died
for good.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
from typing import Any

import anyio

from structllm.engine.async_llm import AsyncLLM
from structllm.errors import StructLLMError
from structllm.server.app import EngineSlot, ServerConfig, build_app

__all__ = ["add_serve_args", "run_server"]


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory, or 'tiny'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--loop", choices=["asyncio", "trio"], default="asyncio")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--request-timeout", type=float, default=None)
    p.add_argument("--max-queued-requests", type=int, default=None)
    p.add_argument("--graceful-timeout", type=float, default=5.0)
    p.add_argument("--shutdown-grace", type=float, default=5.0)
    p.add_argument("--executor", choices=["process", "inline"], default="process")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--default-max-tokens", type=int, default=16)


def run_server(ns: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    return anyio.run(_serve, ns, engine_args, backend=ns.loop)


async def _serve(ns: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from hypercorn.config import Config

    sock = socket.socket(socket.AF_INET6 if ":" in ns.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((ns.host, ns.port))
    sock.listen(1024)
    port = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.graceful_timeout = ns.graceful_timeout
    config.accesslog = None
    config.errorlog = "-"
    name = ns.served_model_name or ns.model
    shutdown = anyio.Event()
    slot = EngineSlot()
    app = build_app(
        slot,
        ServerConfig(
            model_name=name,
            request_timeout=ns.request_timeout,
            default_max_tokens=ns.default_max_tokens,
        ),
    )
    status = 0
    try:
        async with anyio.create_task_group() as tg:
            # listen from the start: /health answers 503 while the model loads
            served = anyio.Event()

            async def serve_http() -> None:
                try:
                    await _hypercorn(app, config, shutdown)
                finally:
                    served.set()

            tg.start_soon(serve_http)
            tg.start_soon(_on_signals, shutdown)
            print(f"structllm: listening on http://{ns.host}:{port}", flush=True)
            try:
                async with AsyncLLM.open(
                    ns.model,
                    tokenizer=ns.tokenizer,
                    executor=ns.executor,
                    max_queued_requests=ns.max_queued_requests,
                    shutdown_grace=ns.shutdown_grace,
                    max_restarts=ns.max_restarts,
                    **engine_args,
                ) as llm:
                    slot.llm = llm
                    tg.start_soon(_watch_engine, llm, shutdown)
                    print(
                        f"structllm: serving {name!r} on http://{ns.host}:{port}",
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
            tg.cancel_scope.cancel()
    finally:
        if sock.fileno() != -1:
            with contextlib.suppress(OSError):  # hypercorn may have closed it
                sock.close()
    print("structllm: stopped" + (" (the engine died)" if status else ""), flush=True)
    return status


async def _hypercorn(app: Any, config: Any, shutdown: anyio.Event) -> None:
    import sniffio

    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve as trio_serve

        await trio_serve(app, config, shutdown_trigger=shutdown.wait)
    else:
        from hypercorn.asyncio import serve as asyncio_serve

        await asyncio_serve(app, config, shutdown_trigger=shutdown.wait)


async def _on_signals(shutdown: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            print(
                f"structllm: {signal.Signals(signum).name}, shutting down",
                file=sys.stderr,
            )
            shutdown.set()
            return


async def _watch_engine(llm: AsyncLLM, shutdown: anyio.Event) -> None:
    """Stop serving once the engine has died for good (exit status 1)."""
    await llm.wait_statistics(lambda s: s.dead)
    print("structllm: the engine died for good, shutting down", file=sys.stderr)
    shutdown.set()
