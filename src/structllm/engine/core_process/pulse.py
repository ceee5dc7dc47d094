"""Heartbeats through a long step (:class:`Pulse`), for the core loop."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from msgspec.structs import replace

from structllm.engine.child import peak_rss_bytes
from structllm.engine.protocol import Heartbeat, Message

__all__ = ["Pulse"]


class Pulse:
    """Heartbeats through a long step, from a thread of their own.

    The loop sends a heartbeat or a step's output at least once an interval,
    except while a step runs: one that outlasts ``heartbeat_timeout`` (a
    1,024-token prefill on a loaded machine, a slow first compile) would look
    like a dead core. While a step runs, this thread sends the heartbeat
    taken just before it again every ``interval`` (with the peak memory read
    then, not on every step), for at most
    ``step_timeout`` seconds of that step; then it goes quiet, so a wedged
    step is still declared dead, ``heartbeat_timeout`` after that. The
    model's kernels release the GIL, so the thread runs during them.
    """

    def __init__(
        self, send: Callable[[Message], None], interval: float, step_timeout: float
    ) -> None:
        self._send = send
        self._interval = interval
        self._step_timeout = step_timeout
        self._cond = threading.Condition()
        self._beat: Heartbeat | None = None  # None: no step running
        self._step = 0  # which step the beat is for
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="structllm-core-pulse", daemon=True
        )
        self._thread.start()

    @contextlib.contextmanager
    def during_step(self, beat: Heartbeat) -> Iterator[None]:
        with self._cond:
            self._beat = beat
            self._step += 1
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._beat = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._beat is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                step, started = self._step, time.monotonic()
            while True:
                with self._cond:
                    self._cond.wait(self._interval)
                    beat = self._beat
                    if self._closed or beat is None or self._step != step:
                        break
                if time.monotonic() - started >= self._step_timeout:
                    continue  # a wedged step: quiet until it ends
                with contextlib.suppress(OSError):
                    self._send(replace(beat, peak_rss_bytes=peak_rss_bytes()))
