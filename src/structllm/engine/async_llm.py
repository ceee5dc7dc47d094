"""``AsyncLLM``: the structured-concurrency front end of the engine.

    async with AsyncLLM.open("tiny") as llm:                  # trio or asyncio
        async with llm.stream("Hello", SamplingParams(max_tokens=32)) as s:
            async for out in s:
                print(out.outputs[0].text, end="")

``open()`` owns one task group. Inside it run the *supervisor* (starts the
engine-core worker, restarts it when it dies, bounded), and per worker
generation the *router* (reads step results, detokenises, delivers) and the
*writer* (sends requests and aborts). Leaving ``open()`` stops admission,
lets in-flight requests finish for ``shutdown_grace`` seconds, fails the rest
with EngineDeadError, and stops the worker: no task, thread or process
outlives the block.

Each request belongs to whoever consumes it. Registration with the front end
and submission to the core happen together, synchronously, so cancellation
cannot split them; releasing a request (leaving its ``stream`` block for any
reason) sends the abort synchronously too, so no cleanup ever has to await
under cancellation. The core frees the request's KV blocks before its next
step.

Outputs travel through a one-slot mailbox per request: when the consumer
lags, new deltas merge into the pending one, so a slow consumer costs memory
in proportion to its own tokens and never blocks the router.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.abc
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from structllm.core.engine_core import EngineConfig, RequestStepOutput, check_prompt
from structllm.engine.executor import (
    WorkerConnection,
    open_inline_worker,
    open_process_worker,
)
from structllm.engine.inputs import PromptInput, parse_prompt_off_loop
from structllm.engine.output_processor import RequestState, merge_outputs
from structllm.engine.protocol import (
    AbortRequests,
    AddFailed,
    AddRequest,
    Fatal,
    Heartbeat,
    LoadProgressMsg,
    Message,
    Ready,
    Shutdown,
    Start,
    StepResult,
    encode,
)
from structllm.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
    RequestFailedError,
)
from structllm.model.sampler import TokenLogprobs
from structllm.outputs import RequestOutput
from structllm.params import OutputKind, SamplingParams
from structllm.text.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "AsyncLLM",
    "EngineStatistics",
    "FrontendConfig",
    "RequestStream",
    "WorkerCrashedError",
]


class WorkerCrashedError(RuntimeError):
    """The worker reported a fatal error; carries the remote traceback."""

    def __init__(self, kind: str, message: str, remote_traceback: str) -> None:
        super().__init__(
            f"{kind}: {message}\n--- worker traceback ---\n{remote_traceback}"
        )
        self.kind = kind


class _WorkerLost(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


@attrs.frozen(kw_only=True)
class FrontendConfig:
    """Front-end settings of :meth:`AsyncLLM.open` (engine settings are separate)."""

    executor: Literal["process", "inline"] = "process"
    tokenizer: str | None = None
    #: refuse new requests with EngineOverloadedError once this many wait
    #: beyond what the core runs at once (max_num_seqs); None = no limit
    max_queued_requests: int | None = None
    #: seconds that leaving open() waits for in-flight requests
    shutdown_grace: float = 5.0
    heartbeat_interval: float = 1.0
    #: a worker silent this long (no heartbeat, no step) is declared dead
    heartbeat_timeout: float = 10.0
    startup_timeout: float = 600.0
    #: restarts allowed within restart_window seconds before giving up
    max_restarts: int = 3
    restart_window: float = 300.0
    restart_backoff: float = 0.25
    show_progress: bool = True
    #: prompts longer than this in UTF-8 are refused before tokenising;
    #: None = 32 bytes per token of max_model_len (at least 64 KiB)
    max_prompt_bytes: int | None = None
    #: check_health() and statistics().healthy report unhealthy once the
    #: worker has been silent this long; None = 3 heartbeat intervals (a
    #: step longer than this also reads as unhealthy until it ends)
    health_timeout: float | None = None
    #: test hook forwarded to the worker ("raise_at_step:N", "hang_at_step:N",
    #: "exit_at_step:N") for its first ``fault_starts`` starts
    fault: str | None = None
    fault_starts: int = 1


@attrs.frozen(kw_only=True)
class EngineStatistics:
    """A snapshot; the counts come from the worker's latest report."""

    live_requests: int
    running: int
    waiting: int
    blocks_used: int
    num_blocks: int
    total_preemptions: int
    restarts: int
    ready: bool
    dead: bool
    worker_pid: int | None
    #: seconds since the worker was last heard from (None: no worker)
    silent_for: float | None = None
    #: ready, not dead, and heard from within the health timeout
    healthy: bool = False


@attrs.define(eq=False)
class _Live:
    """Front-end side of one request: its output state and mailbox."""

    request_id: str
    state: RequestState
    #: the id on the wire: unique per submission, so a caller's id can be
    #: reused at once without a late result for the old request landing here
    wire_id: str = ""
    scope: anyio.CancelScope | None = None
    error: BaseException | None = None
    #: no more outputs will be delivered (finished, aborted or failed)
    closed: bool = False
    _pending: RequestOutput | None = None
    _event: anyio.Event = attrs.Factory(anyio.Event)

    def deliver(self, out: RequestOutput) -> None:
        if (
            self._pending is not None
            and self.state.params.output_kind is OutputKind.DELTA
        ):
            out = merge_outputs(self._pending, out)
        self._pending = out  # cumulative and final outputs supersede
        self._event.set()

    def close(self, error: BaseException | None = None) -> None:
        self.closed = True
        if error is not None and self.error is None:
            self.error = error
        self._event.set()

    async def next(self) -> RequestOutput | None:
        """The next output, or None at the end; raises the request's error.

        Always a checkpoint (as trio expects of every async call), so a
        cancelled consumer stops here even when an output is ready.
        """
        await anyio.lowlevel.checkpoint()
        while True:
            if self._pending is not None:
                out, self._pending = self._pending, None
                return out
            if self.error is not None:
                raise self.error
            if self.closed:
                await anyio.lowlevel.checkpoint_if_cancelled()
                return None
            await self._event.wait()
            self._event = anyio.Event()


class RequestStream:
    """``async with llm.stream(...) as s: async for out in s`` (see AsyncLLM.stream)."""

    def __init__(
        self,
        llm: AsyncLLM,
        prompt: PromptInput,
        params: SamplingParams | None,
        request_id: str | None,
        priority: int,
    ) -> None:
        self._llm = llm
        self._prompt = prompt
        self._params = SamplingParams() if params is None else params
        #: known before anything is registered, so any request can be aborted
        self.request_id = request_id if request_id is not None else uuid.uuid4().hex
        self._priority = priority
        self._live: _Live | None = None
        self._scope: anyio.CancelScope | None = None

    @property
    def finish_reason(self) -> str | None:
        return None if self._live is None else self._live.state.finish_reason

    @property
    def final_output(self) -> RequestOutput | None:
        """Everything generated so far, whatever the output kind."""
        return None if self._live is None else self._live.state.snapshot()

    async def __aenter__(self) -> RequestStream:
        self._live = await self._llm._submit(
            self._prompt, self._params, self.request_id, self._priority
        )
        self._scope = anyio.CancelScope()
        self._scope.__enter__()
        self._live.scope = self._scope
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._live is not None and self._scope is not None
        try:
            self._llm._release(self._live)
        finally:
            swallowed = self._scope.__exit__(exc_type, exc, tb)
        return swallowed

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._live is None:
            raise RuntimeError("use the stream inside `async with llm.stream(...)`")
        out = await self._live.next()
        if out is None:
            raise StopAsyncIteration
        return out


class AsyncLLM:
    """The async engine. Build it with :meth:`open`; see the module docstring."""

    def __init__(
        self, engine: EngineConfig, front: FrontendConfig, tokenizer: Tokenizer
    ) -> None:
        self.engine_config = engine
        self.config = front
        self.tokenizer = tokenizer
        self._live: dict[str, _Live] = {}
        self._wire: dict[str, _Live] = {}
        self._submissions = itertools.count()
        #: encoded frames for the writer: a message that cannot be encoded fails
        #: at its sender (one request), never in the writer (every request)
        self._outgoing: MemoryObjectSendStream[bytes] | None = None
        self._ready = False
        self._ready_event = anyio.Event()
        self._idle_event = anyio.Event()
        self._info: Ready | None = None
        self._dead: EngineDeadError | None = None
        self._closing = False
        self._restarts = 0
        self._counts = Heartbeat()
        self._preemptions = 0
        self._eos: frozenset[int] = frozenset(tokenizer.eos_token_ids)
        self._stats_event = anyio.Event()
        self._last_heard: float | None = None

    # ------------------------------------------------------------------ open

    @classmethod
    def open(cls, model: str, **kwargs: Any) -> AbstractAsyncContextManager[AsyncLLM]:
        """Start an engine for ``model`` (a directory or ``"tiny"``).

        Keyword arguments are the fields of :class:`EngineConfig` (engine:
        ``max_model_len``, ``num_blocks``, ...) and of :class:`FrontendConfig`
        (``executor``, ``shutdown_grace``, ``max_restarts``, ...). Startup
        errors (a bad checkpoint) raise from ``open`` itself.
        """
        engine_fields = attrs.fields_dict(EngineConfig)
        front_fields = attrs.fields_dict(FrontendConfig)
        engine_kw: dict[str, Any] = {}
        front_kw: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in engine_fields:
                engine_kw[key] = value
            elif key in front_fields:
                front_kw[key] = value
            else:
                raise TypeError(f"AsyncLLM.open() got an unexpected argument {key!r}")
        return cls._open(
            EngineConfig(model=str(model), **engine_kw), FrontendConfig(**front_kw)
        )

    @classmethod
    @asynccontextmanager
    async def _open(
        cls, engine: EngineConfig, front: FrontendConfig
    ) -> AsyncIterator[AsyncLLM]:
        tokenizer = load_tokenizer(front.tokenizer or engine.model)
        llm = cls(engine, front, tokenizer)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(llm._supervise)
                try:
                    yield llm
                finally:
                    with anyio.CancelScope(shield=True):
                        await llm._shutdown()
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # Error contract: a startup failure (ModelLoadError, EngineDeadError)
            # or an exception from the caller's own block comes out unwrapped;
            # several at once (an internal failure too) stay a group.
            if len(group.exceptions) == 1 and isinstance(
                group.exceptions[0], Exception
            ):
                exc = group.exceptions[0]
                exc.__suppress_context__ = True
                raise exc  # noqa: B904 - the group is only a wrapper here
            raise

    # ------------------------------------------------------------ public API

    def stream(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """A request as an async context manager yielding an async iterator.

        Leaving the block early, a deadline, cancellation of the task, or
        :meth:`abort` ends the request; ``finish_reason`` is then ``"abort"``.
        Raises InvalidRequestError / EngineOverloadedError at entry, and
        EngineDeadError at entry or while iterating if the engine dies.
        """
        return RequestStream(self, prompt, params, request_id, priority)

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM-style async generator. Close it deterministically::

            async with contextlib.aclosing(llm.generate(p, sp)) as agen:
                async for out in agen: ...

        It holds no cancel scope across ``yield`` (that would break
        structured concurrency); closing it releases the request.
        """
        live = await self._submit(
            prompt,
            SamplingParams() if params is None else params,
            request_id if request_id is not None else uuid.uuid4().hex,
            priority,
        )
        try:
            while (out := await live.next()) is not None:
                yield out
        finally:
            self._release(live)

    async def complete(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestOutput:
        """Run a request to the end and return only its final output."""
        params = attrs.evolve(
            SamplingParams() if params is None else params, output_kind=OutputKind.FINAL
        )
        last = None
        s = self.stream(prompt, params, request_id=request_id, priority=priority)
        async with s:
            async for out in s:
                last = out
        if last is None:  # aborted before it produced anything
            last = s.final_output
        assert last is not None
        return last

    async def abort(self, request_id: str) -> None:
        """End ``request_id`` now: cancels its stream block; idempotent."""
        live = self._live.get(request_id)
        if live is not None:
            # cancel first: a consumer woken by the release alone would see
            # a normal end of stream and run on inside its block
            if live.scope is not None:
                live.scope.cancel()
            self._release(live)
        await anyio.lowlevel.checkpoint()

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine has died for good."""
        if self._dead is not None:
            raise self._new_dead_error()
        await anyio.lowlevel.checkpoint()

    def statistics(self) -> EngineStatistics:
        c = self._counts
        silent = None
        if self._ready and self._last_heard is not None:
            silent = anyio.current_time() - self._last_heard
        healthy = (
            self._ready
            and self._dead is None
            and silent is not None
            and silent <= self.health_timeout
        )
        return EngineStatistics(
            live_requests=len(self._live),
            running=c.num_running,
            waiting=c.num_waiting,
            blocks_used=c.blocks_used,
            num_blocks=0 if self._info is None else self._info.num_blocks,
            total_preemptions=self._preemptions,
            restarts=self._restarts,
            ready=self._ready,
            dead=self._dead is not None,
            worker_pid=None if self._info is None else self._info.pid,
            silent_for=silent,
            healthy=healthy,
        )

    @property
    def health_timeout(self) -> float:
        t = self.config.health_timeout
        if t is None:
            t = min(3 * self.config.heartbeat_interval, self.config.heartbeat_timeout)
        return t

    @property
    def max_prompt_bytes(self) -> int | None:
        """The byte cap on prompts (None until the context length is known)."""
        if self.config.max_prompt_bytes is not None:
            return self.config.max_prompt_bytes
        if self._info is None:
            return None
        return max(64 << 10, 32 * self._info.max_model_len)

    @property
    def vocab_size(self) -> int:
        assert self._info is not None
        return self._info.vocab_size

    async def wait_statistics(
        self, predicate: Callable[[EngineStatistics], bool]
    ) -> EngineStatistics:
        """Wait until a fresh snapshot satisfies ``predicate``; return it.

        The worker reports after every step and whenever it goes idle, so
        ``wait_statistics(lambda s: s.blocks_used == 0)`` returns as soon as
        aborted requests' blocks are back. Bound it with a deadline.
        """
        while not predicate(stats := self.statistics()):
            await self._stats_event.wait()
        return stats

    def _stats_updated(self) -> None:
        self._stats_event.set()
        self._stats_event = anyio.Event()

    @property
    def max_model_len(self) -> int:
        assert self._info is not None
        return self._info.max_model_len

    # ------------------------------------------------------- request plumbing

    async def _submit(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str,
        priority: int,
    ) -> _Live:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params must be SamplingParams, got {type(params).__name__}",
                field="params",
            )
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(
                "request_id must be a non-empty string", field="request_id"
            )
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(
                f"priority must be an integer, got {priority!r}", field="priority"
            )
        parsed = await parse_prompt_off_loop(
            prompt, self.tokenizer, max_bytes=self.max_prompt_bytes
        )
        while not self._ready:
            self._check_admitting()
            await self._ready_event.wait()
        # From here to the end: no await. Registered and submitted, or neither.
        info = self.check_admission(parsed.token_ids, params=params)
        if request_id in self._live:
            raise InvalidRequestError(
                f"request_id {request_id!r} is already in use by a live request",
                field="request_id",
            )
        ids = parsed.token_ids
        wire_id = f"{request_id}#{next(self._submissions)}"
        live = _Live(
            request_id,
            RequestState(request_id, parsed.text, ids, params, self.tokenizer),
            wire_id=wire_id,
        )
        frame = _encode_request(
            AddRequest(
                request_id=wire_id,
                prompt_token_ids=list(ids),
                params=_params_to_wire(params),
                eos_token_ids=sorted(self._eos | frozenset(info.eos_token_ids)),
                priority=priority,
            )
        )
        assert self._outgoing is not None
        try:
            self._outgoing.send_nowait(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            # the worker just died; its teardown has not reached us yet
            raise EngineDeadError("the engine core died; it is restarting") from None
        self._live[request_id] = live
        self._wire[wire_id] = live
        return live

    def check_admission(
        self,
        prompt_token_ids: Sequence[int],
        count: int = 1,
        *,
        params: SamplingParams | None = None,
    ) -> Ready:
        """Raise now what submitting ``count`` requests for this prompt would.

        EngineDeadError when dead, shutting down or restarting;
        InvalidRequestError for a prompt the model cannot take;
        EngineOverloadedError when admission control would refuse. Servers
        call it before promising a streaming response.
        """
        self._check_admitting()
        info = self._info
        if not self._ready or info is None or self._outgoing is None:
            raise EngineDeadError("the engine core is restarting")
        check_prompt(
            prompt_token_ids,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
        )
        if params is not None:
            _check_token_ids(params, info.vocab_size)
        limit = self.config.max_queued_requests
        if (
            limit is not None
            and len(self._live) + count > self.engine_config.max_num_seqs + limit
        ):
            raise EngineOverloadedError(
                f"{len(self._live)} requests in flight; max_queued_requests={limit} "
                "are already waiting beyond max_num_seqs"
            )
        return info

    def _check_admitting(self) -> None:
        if self._dead is not None:
            raise self._new_dead_error()
        if self._closing:
            raise EngineDeadError("the engine is shutting down")

    def _new_dead_error(self) -> EngineDeadError:
        assert self._dead is not None
        err = EngineDeadError(str(self._dead))
        err.__cause__ = self._dead.__cause__
        return err

    def _release(self, live: _Live) -> None:
        """The consumer is done with ``live``: abort it in the core if unfinished."""
        if self._live.get(live.request_id) is live:
            self._send_nowait(AbortRequests([live.wire_id]))
            # a generate() consumer reads on: give it the finished "abort" output
            live.deliver(live.state.abort())
            self._retire(live)
        live.close()

    def _retire(self, live: _Live) -> None:
        del self._live[live.request_id]
        self._wire.pop(live.wire_id, None)
        if not self._live:
            self._idle_event.set()
            self._idle_event = anyio.Event()

    def _send_nowait(self, msg: Message) -> None:
        if self._outgoing is None:
            return  # no worker: nothing to tell
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._outgoing.send_nowait(encode(msg))

    def _fail_all(self, make_error: Callable[[], BaseException]) -> None:
        for live in list(self._live.values()):
            live.state.abort("error")
            self._retire(live)
            live.close(make_error())

    # ------------------------------------------------------------ supervisor

    async def _supervise(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        failures: list[float] = []
        starts = 0
        started = False
        while True:
            cause: BaseException | None = None
            async with self._open_worker() as conn:
                starts += 1
                fault = (
                    self.config.fault if starts <= self.config.fault_starts else None
                )
                try:
                    self._info = await self._handshake(conn, fault)
                    self._last_heard = anyio.current_time()
                    send, receive = anyio.create_memory_object_stream[bytes](math.inf)
                    self._outgoing = send
                    self._ready = True
                    self._ready_event.set()
                    self._stats_updated()
                    if not started:
                        started = True
                        task_status.started()
                    await self._serve(conn, receive)
                except _WorkerLost as lost:
                    cause = lost.cause
                except ModelLoadError as exc:
                    if not started:
                        raise
                    cause = exc
                finally:
                    self._on_worker_gone()
                if cause is not None:
                    # fail requests now, not after the worker is reaped
                    conn.kill()
                    if started:
                        self._fail_all(
                            functools.partial(
                                _dead_error, "the engine core died", cause
                            )
                        )
            assert cause is not None
            if self._closing:
                return
            if not started:
                raise EngineDeadError(
                    f"the engine core failed to start: {cause}"
                ) from cause
            now = anyio.current_time()
            failures = [t for t in failures if now - t < self.config.restart_window] + [
                now
            ]
            if len(failures) > self.config.max_restarts:
                self._dead = _dead_error(
                    f"the engine core died {len(failures)} times within "
                    f"{self.config.restart_window:g}s; not restarting",
                    cause,
                )
                self._ready_event.set()  # wake waiting submitters: they see _dead
                self._stats_updated()
                return
            self._restarts += 1
            await anyio.sleep(self.config.restart_backoff * 2 ** (len(failures) - 1))

    def _on_worker_gone(self) -> None:
        self._stats_updated()
        self._ready = False
        self._ready_event = anyio.Event()
        if self._outgoing is not None:
            self._outgoing.close()
            self._outgoing = None

    def _open_worker(self) -> AbstractAsyncContextManager[WorkerConnection]:
        if self.config.executor == "inline":
            return open_inline_worker()
        if self.config.executor == "process":
            return open_process_worker()
        raise InvalidRequestError(
            f"executor must be 'process' or 'inline', got {self.config.executor!r}",
            field="executor",
        )

    async def _handshake(self, conn: WorkerConnection, fault: str | None) -> Ready:
        await conn.send(
            Start(
                config=attrs.asdict(self.engine_config),
                heartbeat_interval=self.config.heartbeat_interval,
                fault=fault,
            )
        )
        bars: dict[str, Any] = {}
        try:
            with anyio.fail_after(self.config.startup_timeout):
                while True:
                    msg = await _receive(conn)
                    if isinstance(msg, LoadProgressMsg):
                        self._show_progress(bars, msg)
                    elif isinstance(msg, Ready):
                        return msg
                    elif isinstance(msg, Fatal):
                        if msg.during_load:
                            raise ModelLoadError(msg.message)
                        raise _WorkerLost(
                            WorkerCrashedError(msg.kind, msg.message, msg.traceback)
                        )
        except TimeoutError as exc:
            raise _WorkerLost(exc) from None
        finally:
            for bar in bars.values():
                bar.close()

    def _show_progress(self, bars: dict[str, Any], msg: LoadProgressMsg) -> None:
        if not self.config.show_progress:
            return
        from tqdm import tqdm

        bar = bars.get(msg.stage)
        if bar is None:
            bar = bars[msg.stage] = tqdm(
                total=msg.total, desc=f"engine {msg.stage}", leave=False
            )
        bar.update(msg.done - bar.n)

    async def _serve(
        self, conn: WorkerConnection, outgoing: MemoryObjectReceiveStream[bytes]
    ) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._write, conn, outgoing)
                if conn.process is not None:
                    tg.start_soon(self._watch_process, conn.process)
                await self._route(conn)
        except* _WorkerLost as group:
            raise group.exceptions[0] from None

    async def _write(
        self, conn: WorkerConnection, outgoing: MemoryObjectReceiveStream[bytes]
    ) -> None:
        try:
            async with outgoing:
                async for frame in outgoing:
                    await conn.send_frame(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise _WorkerLost(exc) from None

    async def _watch_process(self, process: anyio.abc.Process) -> None:
        code = await process.wait()
        raise _WorkerLost(
            ChildProcessError(f"the worker process exited with code {code}")
        )

    async def _route(self, conn: WorkerConnection) -> None:
        while True:
            try:
                with anyio.fail_after(self.config.heartbeat_timeout):
                    msg = await _receive(conn)
                self._last_heard = anyio.current_time()
            except TimeoutError:
                raise _WorkerLost(
                    TimeoutError(
                        f"no heartbeat from the worker for {self.config.heartbeat_timeout:g}s"
                    )
                ) from None
            if isinstance(msg, StepResult):
                self._on_step(msg)
            elif isinstance(msg, Heartbeat):
                self._counts = msg
                self._stats_updated()
            elif isinstance(msg, AddFailed):
                live = self._wire.get(msg.request_id)
                if live is not None:
                    self._retire(live)
                    live.close(InvalidRequestError(msg.message, field=msg.field))
            elif isinstance(msg, Fatal):
                raise _WorkerLost(
                    WorkerCrashedError(msg.kind, msg.message, msg.traceback)
                )

    def _on_step(self, msg: StepResult) -> None:
        self._counts = Heartbeat(msg.num_running, msg.num_waiting, msg.blocks_used)
        self._preemptions = msg.total_preemptions
        for wo in msg.outputs:
            live = self._wire.get(wo.request_id)
            if live is None:
                continue  # released already; its abort is on the way
            step = RequestStepOutput(
                request_id=live.request_id,
                new_token_ids=tuple(wo.new_token_ids),
                logprobs=None
                if wo.logprobs is None
                else tuple(
                    TokenLogprobs(a, b, tuple(c), tuple(d))
                    for a, b, c, d in wo.logprobs
                ),
                finish_reason=wo.finish_reason,  # type: ignore[arg-type]
                stop_reason=wo.stop_reason,
                queue_s=wo.queue_s,
                num_cached_tokens=wo.num_cached_tokens,
            )
            try:
                out = live.state.process(step)
            except Exception as exc:  # e.g. detokenising: this request alone fails
                self._send_nowait(AbortRequests([wo.request_id]))
                live.state.abort("error")
                self._retire(live)
                failure = RequestFailedError(f"the request failed: {exc!r}")
                failure.__cause__ = exc
                live.close(failure)
                continue
            if live.state.finished:
                if wo.finish_reason is None:  # a stop string: the core doesn't know
                    self._send_nowait(AbortRequests([wo.request_id]))
                self._retire(live)
            if out is not None:
                live.deliver(out)
            if live.state.finished:
                live.close()
        self._stats_updated()

    # -------------------------------------------------------------- shutdown

    async def _shutdown(self) -> None:
        self._closing = True
        self._ready_event.set()  # submitters waiting for a restart: "shutting down"
        with anyio.move_on_after(self.config.shutdown_grace):
            while self._live:
                await self._idle_event.wait()
        self._fail_all(
            lambda: EngineDeadError("the engine shut down before the request finished")
        )
        self._send_nowait(Shutdown())


async def _receive(conn: WorkerConnection) -> Message:
    try:
        return await conn.receive()
    except (
        anyio.EndOfStream,
        anyio.BrokenResourceError,
        anyio.ClosedResourceError,
        OSError,
        ValueError,  # a malformed frame (msgspec.DecodeError is a ValueError)
    ) as exc:
        raise _WorkerLost(
            ConnectionError(f"the worker connection closed ({exc!r})")
        ) from None


def _dead_error(message: str, cause: BaseException) -> EngineDeadError:
    err = EngineDeadError(f"{message}: {cause}")
    err.__cause__ = cause
    return err


def _encode_request(msg: AddRequest) -> bytes:
    """The request's frame; a value the wire cannot carry fails this request only."""
    try:
        return encode(msg)
    except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as exc:
        raise InvalidRequestError(
            f"the request cannot be sent to the engine: {exc}", field=None
        ) from exc


def _check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids in ``params`` must lie in the model's vocabulary."""
    fields: tuple[tuple[str, Sequence[int]], ...] = (
        ("stop_token_ids", params.stop_token_ids),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("logit_bias", [t for t, _ in params.logit_bias]),
    )
    for name, ids in fields:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{name} has token id {bad[0]}, outside the vocabulary "
                f"[0, {vocab_size})",
                field=name,
            )


def _params_to_wire(p: SamplingParams) -> dict[str, Any]:
    d = attrs.asdict(p, recurse=False)
    d["output_kind"] = p.output_kind.value
    d["stop"] = list(p.stop)
    d["stop_token_ids"] = list(p.stop_token_ids)
    return d
