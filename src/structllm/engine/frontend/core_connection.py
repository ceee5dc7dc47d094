"""Where the engine core runs, the socket to it, and the handshake.

Both ways to run a core are async context managers yielding a
:class:`CoreConnection` over a socketpair speaking
:mod:`structllm.engine.protocol`, so the client drives them alike:

- :func:`open_core_process` (``executor="process"``, the default): a fresh
  interpreter, ``python -m structllm.engine.core_process --fd N``, holding
  the other end of the pair (``pass_fds``). It exits on EOF, on Shutdown,
  or when this process dies.
- :func:`open_core_thread` (``executor="inline"``): the same loop in a
  dedicated thread of this process, for tests and notebooks.

Leaving the context closes the socket and waits for the core, bounded; a
process that does not exit in time is killed. Nothing outlives the block
except a *hung* thread, which Python cannot kill.

:func:`handshake` starts a core that has just been opened: it sends
``Start`` and relays ``LoadProgressMsg``s to progress bars until ``Ready``.
A core that breaks off (its socket closes, a malformed frame, silence past
a timeout) raises :class:`CoreLost`, which the client treats as a death.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import attrs

from structllm.engine.protocol import (
    CoreRequest,
    Fatal,
    FrameReader,
    LoadProgressMsg,
    Message,
    Ready,
    Start,
    encode,
)
from structllm.errors import (
    EngineConfigError,
    EngineCoreError,
    InvalidRequestError,
    load_error,
)

__all__ = [
    "CoreConnection",
    "CoreLost",
    "core_process_command",
    "encode_request",
    "handshake",
    "open_core",
    "open_core_process",
    "open_core_thread",
    "receive",
]


@attrs.define(eq=False)
class CoreConnection:
    """A socket to a running core, and its process (None for a thread)."""

    stream: anyio.abc.ByteStream
    process: anyio.abc.Process | None = None
    _reader: FrameReader = attrs.Factory(FrameReader)
    _backlog: deque[Message] = attrs.Factory(deque)
    _socket: socket.socket = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._socket = self.stream.extra(anyio.abc.SocketAttribute.raw_socket)

    async def receive(self) -> Message:
        """The next message; raises anyio.EndOfStream when the core is gone.

        A checkpoint, like a stream's ``receive()``, but the socket is read
        here: anyio 4.16's asyncio UNIX stream waits with a reader callback
        that sets a future, which raises ``InvalidStateError`` in the event
        loop when the socket turns readable in the same loop iteration that
        cancels the read. ``anyio.wait_readable`` has no such race. The wait
        for the socket is the checkpoint when there is one (a step's output
        usually finds the reader waiting): a second pass through the event
        loop a step would cost a ``select`` of its own.
        """
        if self._backlog:
            return self._backlog.popleft()
        sock = self._socket
        waited = False
        while not self._backlog:
            try:
                data = sock.recv(1 << 16)
            except BlockingIOError:
                await anyio.wait_readable(sock)
                waited = True
                continue
            if not data:
                if not waited:
                    await anyio.lowlevel.checkpoint()
                raise anyio.EndOfStream
            self._backlog.extend(self._reader.feed(data))
        if not waited:
            await anyio.lowlevel.checkpoint()
        return self._backlog.popleft()

    async def send(self, msg: Message) -> None:
        await self.stream.send(encode(msg))

    async def send_frame(self, frame: bytes) -> None:
        """Send a message already encoded with :func:`protocol.encode`."""
        await self.stream.send(frame)

    def kill(self) -> None:
        """Kill a core process that died or hung (a thread cannot be killed)."""
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()


def core_process_command(fd: int) -> list[str]:
    """The core process's command line, serving on inherited socket ``fd``."""
    return [
        sys.executable,
        "-m",
        "structllm.engine.core_process",
        "--fd",
        str(fd),
        "--parent-pid",
        str(os.getpid()),
    ]


@asynccontextmanager
async def open_core_process(
    *, exit_timeout: float = 10.0
) -> AsyncIterator[CoreConnection]:
    """Start ``python -m structllm.engine.core_process`` on a socketpair.

    Leaving closes the socket (the core exits on EOF) and waits for the
    process, bounded; one that does not exit in time is killed.
    """
    ours, theirs = socket.socketpair()
    try:
        process = await anyio.open_process(
            core_process_command(theirs.fileno()),
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=None,
            stderr=None,
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    stream = await anyio.abc.UNIXSocketStream.from_socket(ours)
    try:
        yield CoreConnection(stream, process)
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
            with anyio.move_on_after(exit_timeout):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            await process.aclose()


@asynccontextmanager
async def open_core_thread(
    *, exit_timeout: float = 10.0
) -> AsyncIterator[CoreConnection]:
    """Run the core process's loop in a thread of this process, over a socketpair.

    A dedicated thread, joined on exit: pooled threads (trio's thread cache)
    would outlive the block and be torn down mid-Paddle at interpreter exit.
    A *hung* thread cannot be killed; use the process where that matters.
    """
    from structllm.engine.core_process.loop import serve

    ours, theirs = socket.socketpair()

    def run() -> None:
        try:
            serve(theirs)
        finally:
            theirs.close()

    thread = threading.Thread(target=run, name="structllm-inline-core", daemon=True)
    thread.start()
    stream = await anyio.abc.UNIXSocketStream.from_socket(ours)
    try:
        yield CoreConnection(stream)
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()  # the loop ends on EOF
            with anyio.move_on_after(exit_timeout):
                await anyio.to_thread.run_sync(thread.join, abandon_on_cancel=True)


def open_core(executor: str) -> AbstractAsyncContextManager[CoreConnection]:
    """A fresh core for ``executor`` ("process" or "inline")."""
    if executor == "inline":
        return open_core_thread()
    if executor == "process":
        return open_core_process()
    raise EngineConfigError(
        f"executor must be 'process' or 'inline', got {executor!r}", field="executor"
    )


def encode_request(request: CoreRequest) -> bytes:
    """The request's frame; a value the wire cannot carry fails this request only."""
    try:
        return encode(request)
    except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as exc:
        raise InvalidRequestError(
            f"the request cannot be sent to the engine: {exc}", field=None
        ) from exc


# -------------------------------------------------------------- handshake


class CoreLost(Exception):
    """The core broke off (``cause`` says how); the client restarts it."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


async def receive(conn: CoreConnection) -> Message:
    """The next message; CoreLost when the connection ends or is garbled."""
    try:
        return await conn.receive()
    except (
        anyio.EndOfStream,
        anyio.BrokenResourceError,
        anyio.ClosedResourceError,
        OSError,
        ValueError,  # a malformed frame (protocol.FrameError)
    ) as exc:
        raise CoreLost(
            ConnectionError(f"the engine core connection closed ({exc!r})")
        ) from None


async def handshake(
    conn: CoreConnection, start: Start, *, startup_timeout: float, show_progress: bool
) -> Ready:
    """Send ``start``; return the core's ``Ready`` once it has loaded.

    A load failure raises the front end's copy of it (ModelLoadError,
    EngineConfigError, :func:`~structllm.errors.load_error`); any other
    failure, or no ``Ready`` within ``startup_timeout`` seconds, raises
    CoreLost.
    """
    await conn.send(start)
    bars: dict[str, Any] = {}
    try:
        with anyio.fail_after(startup_timeout):
            while True:
                msg = await receive(conn)
                if isinstance(msg, LoadProgressMsg):
                    if show_progress:
                        _show_progress(bars, msg)
                elif isinstance(msg, Ready):
                    return msg
                elif isinstance(msg, Fatal):
                    if msg.during_load:
                        raise load_error(msg.kind, msg.message, msg.field)
                    raise CoreLost(
                        EngineCoreError(msg.kind, msg.message, msg.traceback)
                    )
    except TimeoutError as exc:
        raise CoreLost(exc) from None
    finally:
        for bar in bars.values():
            bar.close()


def _show_progress(bars: dict[str, Any], msg: LoadProgressMsg) -> None:
    from tqdm import tqdm

    bar = bars.get(msg.stage)
    if bar is None:
        bar = bars[msg.stage] = tqdm(
            total=msg.total, desc=f"engine {msg.stage}", leave=False
        )
    bar.update(msg.done - bar.n)
