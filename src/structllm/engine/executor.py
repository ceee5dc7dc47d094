"""Where the engine core runs: a worker process (default) or a thread.

Both are async context managers yielding a :class:`WorkerConnection` over a
socket speaking :mod:`structllm.engine.protocol`, so the front end drives
them the same way. Leaving the context closes the socket (the worker exits
on EOF) and waits for the worker, bounded; a process that does not exit in
time is killed. Nothing outlives the block, except a *hung* inline thread,
which Python cannot kill (use the process executor where that matters).
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
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import anyio.to_thread
import attrs

from structllm.engine.protocol import FrameReader, Message, encode

__all__ = [
    "WorkerConnection",
    "open_inline_worker",
    "open_process_worker",
    "worker_command",
]


@attrs.define(eq=False)
class WorkerConnection:
    stream: anyio.abc.ByteStream
    process: anyio.abc.Process | None = None
    _reader: FrameReader = attrs.Factory(FrameReader)
    _backlog: deque[Message] = attrs.Factory(deque)

    async def receive(self) -> Message:
        """The next message; raises anyio.EndOfStream when the worker is gone."""
        while not self._backlog:
            data = await self.stream.receive()
            self._backlog.extend(self._reader.feed(data))
        return self._backlog.popleft()

    async def send(self, msg: Message) -> None:
        await self.stream.send(encode(msg))

    async def send_frame(self, frame: bytes) -> None:
        """Send a message already encoded with :func:`protocol.encode`."""
        await self.stream.send(frame)

    def kill(self) -> None:
        """Kill a worker process that died or hung (a thread cannot be killed)."""
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()


def worker_command(fd: int) -> list[str]:
    """The worker's command line, serving on inherited socket ``fd``."""
    return [
        sys.executable,
        "-m",
        "structllm.engine.worker",
        "--fd",
        str(fd),
        "--parent-pid",
        str(os.getpid()),
    ]


@asynccontextmanager
async def open_process_worker(
    *, exit_timeout: float = 10.0
) -> AsyncIterator[WorkerConnection]:
    """Start ``python -m structllm.engine.worker`` on one end of a socketpair."""
    ours, theirs = socket.socketpair()
    try:
        process = await anyio.open_process(
            worker_command(theirs.fileno()),
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
        yield WorkerConnection(stream, process)
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()  # the worker exits on EOF
            with anyio.move_on_after(exit_timeout):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            await process.aclose()


@asynccontextmanager
async def open_inline_worker(
    *, exit_timeout: float = 10.0
) -> AsyncIterator[WorkerConnection]:
    """Run the worker loop in a thread of this process, over a socketpair.

    A dedicated thread, joined on exit: pooled threads (trio's thread cache)
    would outlive the block and be torn down mid-Paddle at interpreter exit.
    """
    from structllm.engine.worker import serve

    ours, theirs = socket.socketpair()

    def run() -> None:
        try:
            serve(theirs)
        finally:
            theirs.close()

    thread = threading.Thread(target=run, name="structllm-inline-worker", daemon=True)
    thread.start()
    stream = await anyio.abc.UNIXSocketStream.from_socket(ours)
    try:
        yield WorkerConnection(stream)
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()  # the loop ends on EOF
            with anyio.move_on_after(exit_timeout):
                await anyio.to_thread.run_sync(thread.join, abandon_on_cancel=True)
