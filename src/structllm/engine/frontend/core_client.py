"""The parent side of the engine core: start it, supervise it, talk to it.

:class:`CoreClient` runs as one task in ``AsyncLLM.open()``'s task group. Its
loop starts the core (a child process running
:mod:`structllm.engine.core_process`, or that same loop in a thread for
``executor="inline"``), shakes hands
(:func:`~structllm.engine.frontend.core_connection.handshake`), then, for as long as that core lives, runs three tasks: the *reader*
(step outputs, heartbeats, refusals; a silence of ``heartbeat_timeout``
means the core hung), the *writer* (an unbounded memory channel of encoded
frames to the socket) and a *watch* on the child's exit. When the core dies
it tells the front end (which fails every live request) *before* reaping
it, then restarts it with exponential backoff, at most ``max_restarts``
times within ``restart_window``; after that the engine is dead for good.

A test fault (:mod:`structllm.testing.faults`) reaches the core through
:data:`core_fault`: a client takes the one of the context it is built in and
sends it in the ``Start`` of its first ``starts`` cores.

Requests are encoded by their sender
(:func:`~structllm.engine.frontend.core_connection.encode_request`), so a value the
wire cannot carry fails that request, never the writer shared by all. Where
the core runs, the socket to it and the handshake are
:mod:`structllm.engine.frontend.core_connection`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Protocol

import anyio
import anyio.abc
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from structllm.config import EngineConfig, FrontendConfig
from structllm.engine.frontend.core_connection import (
    CoreConnection,
    CoreLost,
    handshake,
    open_core,
    receive,
)
from structllm.engine.frontend.core_fault import CoreFault, core_fault
from structllm.engine.protocol import (
    ANSWERS,
    AddFailed,
    CoreState,
    Fatal,
    Heartbeat,
    InspectCore,
    Message,
    PrefixCacheReset,
    Ready,
    ResetPrefixCache,
    Shutdown,
    Start,
    StepOutput,
    encode,
)
from structllm.engine.statistics import EngineStatistics
from structllm.errors import (
    EngineConfigError,
    EngineCoreError,
    EngineDeadError,
    ModelLoadError,
    dead_error,
)

__all__ = [
    "CoreClient",
    "CoreFault",
    "EngineStatistics",
    "Relay",
    "core_fault",
    "health_timeout",
]


# --------------------------------------------------------------- supervisor


@attrs.define(eq=False)
class _Question:
    """A question sent to the core; ``answer`` is set before ``done``."""

    done: anyio.Event = attrs.Factory(anyio.Event)
    answer: Message | BaseException | None = None

    async def wait(self) -> Message:
        await self.done.wait()
        if isinstance(self.answer, BaseException):
            raise self.answer
        assert self.answer is not None
        return self.answer

    async def wait_state(self) -> CoreState:
        answer = await self.wait()
        assert isinstance(answer, CoreState)
        return answer


class Relay(Protocol):
    """Where every client's events go, tagged with its replica's index: the
    one relay between the cores and the requests (the replica set; called
    synchronously)."""

    @property
    def closing(self) -> bool:
        """The engine admits nothing more: a core that stops is not restarted."""

    def on_step(self, replica: int, step: StepOutput) -> None: ...

    def on_add_failed(self, replica: int, msg: AddFailed) -> None: ...

    def on_core_lost(self, replica: int, cause: BaseException) -> None:
        """The core died; fail its live requests (it restarts afterwards)."""

    def on_change(self) -> None:
        """Counts, readiness or liveness changed."""


def health_timeout(config: FrontendConfig) -> float:
    """Silence after which a core reads as unhealthy."""
    t = config.health_timeout
    if t is None:
        t = min(3 * config.heartbeat_interval, config.heartbeat_timeout)
    return t


@attrs.define(eq=False)
class CoreClient:
    """Starts, supervises and talks to one engine core; see the module docstring."""

    engine_config: EngineConfig
    config: FrontendConfig
    relay: Relay
    #: this client's replica: the tag of its events
    index: int = 0
    #: the test fault of the context the client was built in
    fault: CoreFault | None = attrs.field(factory=core_fault.get, kw_only=True)
    #: the running core's handshake (None before the first)
    info: Ready | None = None
    #: a core is up and accepts requests
    ready: bool = False
    #: set once the engine is dead for good
    dead: EngineDeadError | None = None
    restarts: int = 0
    counts: Heartbeat = attrs.Factory(Heartbeat)
    total_preemptions: int = 0
    #: the running core's peak resident memory, from its handshake and its
    #: heartbeats (one follows the step that leaves it idle, so the figure is
    #: current once a burst of work has ended)
    peak_rss_bytes: int = 0
    #: prefix-cache (queries, hits) over every core, and the running core's
    prefix_cache: tuple[int, int] = (0, 0)
    _core_prefix_cache: tuple[int, int] = (0, 0)
    #: speculative decoding: drafts, draft tokens, accepted tokens (totals
    #: over every core start, as prefix_cache)
    spec_decode: tuple[int, int, int] = (0, 0, 0)
    _core_spec_decode: tuple[int, int, int] = (0, 0, 0)
    #: requests dropped at their deadline, and tokens skipped (as above)
    expired: tuple[int, int] = (0, 0)
    _core_expired: tuple[int, int] = (0, 0)
    #: questions to the core (reset_prefix_cache(), inspect()) waiting for
    #: their answers, oldest first: the core answers in the order it was asked
    _questions: list[_Question] = attrs.Factory(list)
    #: when the core was last heard from (anyio.current_time())
    last_heard: float | None = None
    _outgoing: MemoryObjectSendStream[bytes] | None = None

    # ------------------------------------------------------------- senders

    def submit_nowait(self, frame: bytes) -> None:
        """Queue an encoded request; EngineDeadError if the core just died."""
        if self._outgoing is None:
            raise EngineDeadError("the engine core is restarting")
        try:
            self._outgoing.send_nowait(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            # the core just died; its teardown has not reached us yet
            raise EngineDeadError("the engine core died; it is restarting") from None

    def send_nowait(self, msg: Message) -> None:
        """Queue ``msg`` if a core runs; without one there is nothing to tell."""
        if self._outgoing is None:
            return
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._outgoing.send_nowait(encode(msg))

    def send_shutdown(self) -> None:
        self.send_nowait(Shutdown())

    def statistics(self, *, live_requests: int) -> EngineStatistics:
        """A snapshot, with the front end's count of live requests."""
        client = self
        c, info = client.counts, client.info
        silent = None
        if client.ready and client.last_heard is not None:
            silent = anyio.current_time() - client.last_heard
        healthy = (
            client.ready
            and client.dead is None
            and silent is not None
            and silent <= health_timeout(self.config)
        )
        return EngineStatistics(
            live_requests=live_requests,
            running=c.num_running,
            waiting=c.num_waiting,
            blocks_used=c.blocks_used,
            num_blocks=0 if info is None else info.num_blocks,
            total_preemptions=client.total_preemptions,
            restarts=client.restarts,
            ready=client.ready,
            dead=client.dead is not None,
            core_pid=None if info is None else info.pid,
            kv_cache_bytes=0 if info is None else info.kv_cache_bytes,
            core_peak_rss_bytes=client.peak_rss_bytes,
            silent_for=silent,
            healthy=healthy,
            prefix_cache_queries=client.prefix_cache[0],
            prefix_cache_hits=client.prefix_cache[1],
            spec_decode_num_drafts=client.spec_decode[0],
            spec_decode_num_draft_tokens=client.spec_decode[1],
            spec_decode_num_accepted_tokens=client.spec_decode[2],
            deadline_expired_requests=client.expired[0],
            deadline_skipped_tokens=client.expired[1],
        )

    async def reset_prefix_cache(self) -> int:
        """Ask the running core to forget its cached prefix blocks; how many
        it dropped (EngineDeadError if none runs: the replica set waits)."""
        answer = await self._ask_nowait(ResetPrefixCache()).wait()
        assert isinstance(answer, PrefixCacheReset)
        return answer.num_blocks

    async def ask(self, question: Message) -> Message:
        """Ask the running core ``question`` (AddLoRA...); its answer."""
        return await self._ask_nowait(question).wait()

    def inspect_nowait(self) -> _Question:
        """Send InspectCore now (a running core); wait for its answer later:
        the core's own record of its requests and blocks, as of every message
        sent before (see :class:`InspectCore`)."""
        return self._ask_nowait(InspectCore())

    def _ask_nowait(self, question: Message) -> _Question:
        asked = _Question()
        if self._outgoing is None:
            asked.answer = EngineDeadError("the engine core is restarting")
            asked.done.set()
            return asked
        self._questions.append(asked)
        self.send_nowait(question)
        return asked

    # ---------------------------------------------------------- supervisor

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the core, restart it when it dies; ``started()`` once it is up.

        A startup failure of the first core raises (ModelLoadError,
        EngineConfigError, EngineDeadError); later deaths are restarts.
        """
        failures: list[float] = []
        starts = 0
        started = False
        while True:
            cause: BaseException | None = None
            async with open_core(self.config.executor) as conn:
                starts += 1
                fault = None
                if self.fault is not None and starts <= self.fault.starts:
                    fault = self.fault.fault
                try:
                    self.info = await handshake(
                        conn,
                        Start(
                            config=self.engine_config,
                            heartbeat_interval=self.config.heartbeat_interval,
                            fault=fault,
                            tokenizer=self.config.tokenizer,
                            heartbeat_timeout=self.config.heartbeat_timeout,
                            step_timeout=self.config.step_timeout,
                        ),
                        startup_timeout=self.config.startup_timeout,
                        show_progress=self.config.show_progress,
                    )
                    self.last_heard = anyio.current_time()
                    self.peak_rss_bytes = self.info.peak_rss_bytes
                    send, receive = anyio.create_memory_object_stream[bytes](math.inf)
                    self._outgoing = send
                    self.ready = True
                    self.relay.on_change()
                    if not started:
                        started = True
                        task_status.started()
                    await self._serve(conn, receive)
                except CoreLost as lost:
                    cause = lost.cause
                except (ModelLoadError, EngineConfigError) as exc:
                    if not started:
                        raise
                    cause = exc
                finally:
                    self._on_core_gone()
                if cause is not None:
                    # fail requests now, not after the core is reaped
                    conn.kill()
                    if started:
                        self.relay.on_core_lost(self.index, cause)
            assert cause is not None
            if self.relay.closing:
                return
            if not started:
                raise EngineDeadError(
                    f"the engine core failed to start: {cause}"
                ) from cause
            now = anyio.current_time()
            window = self.config.restart_window
            failures = [t for t in failures if now - t < window] + [now]
            if len(failures) > self.config.max_restarts:
                self.dead = dead_error(
                    f"the engine core died {len(failures)} times within "
                    f"{window:g}s; not restarting",
                    cause,
                )
                self.relay.on_change()  # waiting submitters see it dead
                return
            self.restarts += 1
            await anyio.sleep(self.config.restart_backoff * 2 ** (len(failures) - 1))

    def _count_prefix_cache(self, step: StepOutput) -> None:
        """Add the core's cumulative counters' growth to this client's
        totals (a restarted core counts from zero again)."""
        queries, hits = step.prefix_cache_queries, step.prefix_cache_hits
        spec = (step.num_drafts, step.num_draft_tokens, step.num_accepted_tokens)
        expired = (step.num_expired, step.expired_tokens_skipped)
        if (
            (queries, hits) == self._core_prefix_cache
            and spec == self._core_spec_decode
            and expired == self._core_expired
        ):
            return  # most steps: no new prompt, draft or expiry
        old_q, old_h = self._core_prefix_cache
        total_q, total_h = self.prefix_cache
        self.prefix_cache = (total_q + queries - old_q, total_h + hits - old_h)
        self._core_prefix_cache = (queries, hits)
        self.spec_decode = tuple(  # type: ignore[assignment]
            total + now - old
            for total, now, old in zip(
                self.spec_decode, spec, self._core_spec_decode, strict=True
            )
        )
        self._core_spec_decode = spec
        self.expired = (
            self.expired[0] + expired[0] - self._core_expired[0],
            self.expired[1] + expired[1] - self._core_expired[1],
        )
        self._core_expired = expired

    def _on_core_gone(self) -> None:
        self.relay.on_change()
        self._core_prefix_cache = (0, 0)  # the next core counts from zero
        self._core_spec_decode = (0, 0, 0)
        self._core_expired = (0, 0)
        for asked in self._questions:
            asked.answer = EngineDeadError("the engine core stopped before answering")
            asked.done.set()
        self._questions.clear()
        self.ready = False
        if self._outgoing is not None:
            self._outgoing.close()
            self._outgoing = None

    async def _serve(
        self, conn: CoreConnection, outgoing: MemoryObjectReceiveStream[bytes]
    ) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._write, conn, outgoing)
                if conn.process is not None:
                    tg.start_soon(self._watch_process, conn.process)
                await self._read(conn)
        except* CoreLost as group:
            raise group.exceptions[0] from None

    async def _write(
        self, conn: CoreConnection, outgoing: MemoryObjectReceiveStream[bytes]
    ) -> None:
        try:
            async with outgoing:
                async for frame in outgoing:
                    await conn.send_frame(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise CoreLost(exc) from None

    async def _watch_process(self, process: anyio.abc.Process) -> None:
        code = await process.wait()
        raise CoreLost(ChildProcessError(f"the core process exited with code {code}"))

    async def _read(self, conn: CoreConnection) -> None:
        """Handle the core's messages; CoreLost after ``heartbeat_timeout``
        of silence.

        One deadline covers many messages: when it passes, it is moved on
        from the last message heard, and only a real silence raises (a
        cancel scope a message cost a timer and a scope a token).
        """
        timeout = self.config.heartbeat_timeout
        while True:
            assert self.last_heard is not None
            with anyio.move_on_at(self.last_heard + timeout):
                while True:
                    msg = await receive(conn)
                    self.last_heard = anyio.current_time()
                    self._handle(msg)
            if anyio.current_time() >= self.last_heard + timeout:
                raise CoreLost(
                    TimeoutError(f"no heartbeat from the engine core for {timeout:g}s")
                )

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, StepOutput):
            self.counts = Heartbeat(msg.num_running, msg.num_waiting, msg.blocks_used)
            self.total_preemptions = msg.total_preemptions
            self._count_prefix_cache(msg)
            self.relay.on_step(self.index, msg)
            self.relay.on_change()
        elif isinstance(msg, Heartbeat):
            self.counts = msg
            self.peak_rss_bytes = max(self.peak_rss_bytes, msg.peak_rss_bytes)
            self.relay.on_change()
        elif isinstance(msg, AddFailed):
            self.relay.on_add_failed(self.index, msg)
        elif isinstance(msg, ANSWERS) and self._questions:
            asked = self._questions.pop(0)
            asked.answer = msg
            asked.done.set()
        elif isinstance(msg, Fatal):
            raise CoreLost(EngineCoreError(msg.kind, msg.message, msg.traceback))
