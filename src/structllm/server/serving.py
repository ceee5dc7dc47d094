"""The serving base: what every OpenAI endpoint does around its own logic.

:class:`Serving` holds the engine slot, the configuration and the metrics.
``guarded()`` takes the body through
:func:`~structllm.server.http.body.receive_json` (JSON only, under a size cap
and a deadline, strict: no NaN, bounded depth; big bodies parsed in a
worker thread), runs the endpoint's handler in a task group that also watches the connection (a
client that leaves cancels it, the request's ``stream`` block exits and the
engine aborts it within one step) under ``--request-timeout``, and turns the
known errors into OpenAI error responses. A request's time limit is the
least of ``--request-timeout``, its ``X-Request-Timeout`` header and its
body's ``timeout`` (:meth:`Serving.limit`); the engine sees it as the
request's deadline (it ranks and drops work by it). ``run_to_end()`` and
``stream()`` run the requests of one response (prompts times ``n``), the
latter as server-sent events whose chunks a :class:`StreamFormat` writes
(each API's is a :class:`Chunks`).
:mod:`~structllm.server.completions.serving` and
:mod:`~structllm.server.chat.serving` are the endpoints.
"""

from __future__ import annotations

import contextvars
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import anyio
import attrs
from anyio.streams.memory import MemoryObjectSendStream
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from structllm.config import ServerConfig
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.frontend.inputs import OFF_LOOP_CHARS, Prompt, check_prompt_bytes
from structllm.errors import EngineLoadingError, InvalidRequestError, unwrap_group
from structllm.outputs import CompletionOutput, RequestOutput
from structllm.params import OutputKind, SamplingParams
from structllm.server.http.access import current_record
from structllm.server.http.body import maybe_off_loop, receive_json
from structllm.server.http.errors import (
    ModelNotFoundError,
    RequestTimeoutError,
    error_response,
)
from structllm.server.http.sse import Emit, EventStream, cancel_on_disconnect, deadline
from structllm.server.metrics import Metrics
from structllm.server.protocol import bodies
from structllm.server.protocol.constraints import rename_field
from structllm.server.protocol.sampling import SamplingRequest

__all__ = [
    "Chunks",
    "EngineSlot",
    "Job",
    "JobTiming",
    "ServerConfig",
    "Serving",
    "StreamFormat",
]

_R = TypeVar("_R", bound=SamplingRequest)


@attrs.define(eq=False)
class EngineSlot:
    """Holds the engine once it is up: the server listens while it loads."""

    llm: AsyncLLM | None = None

    def get(self) -> AsyncLLM:
        if self.llm is None:
            raise EngineLoadingError("the engine is loading")
        return self.llm


@attrs.define(eq=False)
class JobTiming:
    """When one job's outputs arrived (monotonic seconds), for vLLM's
    per-request ``metrics``; :meth:`Serving.observe` fills it in."""

    start: float | None = None
    first: float | None = None
    last: float | None = None
    #: the engine's: from arrival in the core to being scheduled
    queue_time: float | None = None
    tokens: int = 0

    def metrics(self) -> bodies.PerRequestMetrics:
        """The timings as vLLM reports them (null where unknown). Being
        scheduled is ``queue_time`` after the start: the front end's time to
        the core counts as queueing."""
        start, first, last, n = self.start, self.first, self.last, self.tokens
        if start is None or first is None or last is None or self.queue_time is None:
            return bodies.PerRequestMetrics(
                time_to_first_token_ms=None,
                generation_time_ms=None,
                queue_time_ms=None
                if self.queue_time is None
                else self.queue_time * 1e3,
                mean_itl_ms=None,
                tokens_per_second=None,
            )
        scheduled = start + self.queue_time
        generation = last - first
        return bodies.PerRequestMetrics(
            time_to_first_token_ms=max(first - scheduled, 0.0) * 1e3,
            generation_time_ms=generation * 1e3,
            queue_time_ms=self.queue_time * 1e3,
            mean_itl_ms=generation * 1e3 / (n - 1) if n > 1 else None,
            tokens_per_second=n / (last - scheduled) if last > scheduled else None,
        )


@attrs.frozen
class Job:
    """One choice to generate: choice ``index`` of prompt ``prompt_index``."""

    index: int
    prompt_index: int
    prompt: Prompt
    params: SamplingParams
    priority: int = 0
    timing: JobTiming = attrs.field(factory=JobTiming, eq=False)


class StreamFormat(Protocol):
    """How one API writes its chunks; ``usage`` is set for continuous usage."""

    @property
    def include_usage(self) -> bool: ...
    @property
    def continuous_usage(self) -> bool: ...
    def opening(self, job: Job, usage: bodies.Usage | None) -> BaseModel | None: ...
    def delta(
        self, job: Job, out: RequestOutput, usage: bodies.Usage | None
    ) -> BaseModel: ...
    def closing(
        self, usage: bodies.Usage, metrics: bodies.PerRequestMetrics | None
    ) -> BaseModel: ...


@attrs.define(eq=False)
class Serving:
    """The engine, the configuration and the metrics every endpoint shares."""

    slot: EngineSlot
    config: ServerConfig
    metrics: Metrics
    fingerprint: str = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.fingerprint = bodies.fingerprint("structllm", self.config.model_name)

    # -- the guard -----------------------------------------------------------

    async def guarded(
        self, request: Request, handler: Callable[[Any, bool], Awaitable[Response]]
    ) -> Response:
        """Errors -> OpenAI error bodies; a disconnect cancels the handler.

        The body is read first: afterwards the only message left to receive
        is the disconnect, which a watcher task waits for.
        """
        config = self.config
        try:
            _header_timeout.set(header_timeout(request))
        except InvalidRequestError as exc:
            refused = self.error_response(exc)
            assert refused is not None  # a 400
            return refused
        body = await receive_json(request, config.max_body_bytes, config.body_timeout)
        if isinstance(body, Response):
            return body
        try:
            response = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_on_disconnect, request.receive, tg.cancel_scope)
                with deadline(self.limit(None)):
                    response = await handler(body.value, body.big)
                tg.cancel_scope.cancel()
            if response is None:  # the client went away
                return Response(status_code=499)
            return response
        except BaseExceptionGroup as group:
            response = self.error_response(unwrap_group(group))
            if response is None:
                raise
            return response

    def error_response(self, exc: BaseException) -> Response | None:
        return error_response(exc, retry_after=self.config.retry_after)

    def limit(self, timeout: float | None) -> float | None:
        """Seconds this request may take: the least of ``--request-timeout``,
        the ``X-Request-Timeout`` header and ``timeout`` (the body's)."""
        limits = [
            t
            for t in (self.config.request_timeout, _header_timeout.get(), timeout)
            if t is not None
        ]
        return min(limits) if limits else None

    # -- checks shared by the endpoints ----------------------------------------

    def check_model(self, name: str | None) -> None:
        if name and name != self.config.model_name:
            raise ModelNotFoundError(
                f"the model {name!r} does not exist; this server serves "
                f"{self.config.model_name!r}"
            )

    @staticmethod
    def check_length(
        llm: AsyncLLM, ids: Sequence[int], max_tokens: int | None, field: str
    ) -> None:
        room = llm.max_model_len - len(ids)
        if max_tokens is not None and max_tokens > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {llm.max_model_len} "
                f"tokens; the prompt has {len(ids)} and {field}={max_tokens} "
                f"would need {len(ids) + max_tokens}",
                field=field,
            )

    @staticmethod
    async def render_messages(
        llm: AsyncLLM,
        messages: list[dict[str, Any]],
        options: dict[str, Any],
        cache_salt: str | None = None,
    ) -> Prompt:
        """``messages`` through the chat template (``options``: the other
        keywords of ``apply_chat_template``), tokenised; every API that takes
        a conversation renders it here, so they all write the same prompt.

        The text is checked against ``--max-prompt-bytes`` first (as
        ``messages``), and a long conversation is rendered and tokenised in a
        worker thread.
        """
        size = sum(len(m["content"]) for m in messages)
        cap = llm.max_prompt_bytes
        if cap is not None and 4 * size > cap:  # 4: the most bytes per char
            text = "".join(m["content"] for m in messages)
            check_prompt_bytes(text, cap, field="messages")
        tools = options.get("tools")
        # the template writes the tools out too: count them for the thread
        rendered = size + (len(json.dumps(tools)) if tools else 0)

        def render() -> tuple[str, tuple[int, ...]]:
            text = llm.tokenizer.apply_chat_template(messages, **options)
            # the template writes BOS itself: tokenise without special tokens
            return text, tuple(llm.tokenizer.encode(text, add_special_tokens=False))

        text, ids = await maybe_off_loop(rendered > OFF_LOOP_CHARS, render)
        return Prompt(text, ids, cache_salt)

    def prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        # Special tokens spelled out, as in the echoed logprobs' pieces (the
        # text offsets index into this text) and as vLLM echoes them.
        tokenizer = self.slot.get().tokenizer
        return tokenizer.decode(list(prompt.token_ids), skip_special_tokens=False)

    @staticmethod
    def prompt_tokens(jobs: Sequence[Job]) -> int:
        """Prompt tokens counted once per prompt (its n choices share it)."""
        seen = {job.prompt_index: len(job.prompt.token_ids) for job in jobs}
        return sum(seen.values())

    def head(self, rid: str) -> dict[str, Any]:
        """The fields every response and chunk starts with."""
        return {
            "id": rid,
            "created": bodies.now(),
            "model": self.config.model_name,
            "system_fingerprint": self.fingerprint,
        }

    def final_usage(
        self, jobs: Sequence[Job], finals: dict[int, RequestOutput]
    ) -> bodies.Usage:
        return bodies.usage(
            self.prompt_tokens(jobs),
            sum(len(f.outputs[0].token_ids) for f in finals.values()),
            sum(f.num_cached_tokens or 0 for f in finals.values()),
        )

    def wants_metrics(self, include_metrics: bool | None) -> bool:
        """Whether a response carries vLLM's per-request ``metrics``: with
        ``--enable-per-request-metrics``, unless the request's
        ``include_metrics`` is false; ``true`` without the flag is refused."""
        enabled = self.config.enable_per_request_metrics
        if include_metrics and not enabled:
            raise InvalidRequestError(
                "include_metrics: per-request metrics are off on this server "
                "(start it with --enable-per-request-metrics)",
                field="include_metrics",
            )
        return enabled and include_metrics is not False

    @staticmethod
    def request_metrics(jobs: Sequence[Job]) -> bodies.PerRequestMetrics | None:
        """The response's ``metrics``: its one job's timings; None for several
        (prompts or ``n``), which one set of timings cannot describe, as vLLM."""
        return jobs[0].timing.metrics() if len(jobs) == 1 else None

    # -- running requests --------------------------------------------------------

    async def run_to_end(self, jobs: Sequence[Job]) -> dict[int, RequestOutput]:
        """Every job's final output, by choice index (all run concurrently)."""
        finals: dict[int, RequestOutput] = {}

        async def one(job: Job) -> None:
            finals[job.index] = await self.observe(job, None)

        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(one, job)
        return finals

    def stream(
        self,
        llm: AsyncLLM,
        jobs: Sequence[Job],
        fmt: StreamFormat,
        constraint_field: str | None = None,
        timeout: float | None = None,
        metrics: bool = False,
    ) -> EventStream:
        """The jobs' chunks as server-sent events, then ``[DONE]``.

        ``metrics``: the closing usage chunk carries the per-request
        ``metrics`` (:meth:`request_metrics`), as vLLM's last chunk does.

        What can be refused is refused first, before the 200 is promised: a
        bad prompt is a 400 and overload a 503, streaming or not. Errors
        after that (a timeout, an engine death, a grammar only the engine
        core could refuse, named as ``constraint_field``) are the last event.
        ``timeout``: the body's (see :meth:`limit`).
        """
        limit = self.limit(timeout)
        for prompt in {job.prompt_index: job.prompt for job in jobs}.values():
            llm.check_admission(
                prompt.token_ids, count=len(jobs), params=jobs[0].params
            )
        prompt_tokens = self.prompt_tokens(jobs)
        generated = {job.index: 0 for job in jobs}
        cached = {job.index: 0 for job in jobs}

        def usage() -> bodies.Usage:
            return bodies.usage(
                prompt_tokens, sum(generated.values()), sum(cached.values())
            )

        def running_usage() -> bodies.Usage | None:
            return usage() if fmt.continuous_usage else None

        async def one(job: Job, emit: Emit) -> None:
            if (first := fmt.opening(job, running_usage())) is not None:
                await emit(bodies.dump(first))

            async def on_output(o: RequestOutput) -> None:
                generated[job.index] = o.num_generated_tokens
                cached[job.index] = o.num_cached_tokens or 0
                await emit(bodies.dump(fmt.delta(job, o, running_usage())))

            await self.observe(job, on_output)

        async def one_of_several(
            out: MemoryObjectSendStream[dict[str, Any]], job: Job
        ) -> None:
            async def send(event: dict[str, Any] | str) -> None:
                assert not isinstance(event, str)
                out.send_nowait(event)

            with out:
                await one(job, send)

        async def produce(emit: Emit) -> None:
            try:
                if len(jobs) == 1:
                    # the job emits its events itself (a slow client slows
                    # its reads; its mailbox merges what it has not read)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(one, jobs[0], emit)
                else:
                    await produce_several(emit)
            except BaseExceptionGroup as group:
                exc = unwrap_group(group)
                if isinstance(exc, InvalidRequestError):
                    exc = rename_field(exc, constraint_field)
                response = self.error_response(exc)
                if response is None:
                    raise
                await emit(json.loads(bytes(response.body)))
            else:
                if fmt.include_usage:
                    timings = self.request_metrics(jobs) if metrics else None
                    await emit(bodies.dump(fmt.closing(usage(), timings)))
            await emit("[DONE]")

        async def produce_several(emit: Emit) -> None:
            send, receive = anyio.create_memory_object_stream[dict[str, Any]](math.inf)
            with receive:
                async with anyio.create_task_group() as tg:
                    with send:  # each job holds a clone until it is done
                        for job in jobs:
                            tg.start_soon(one_of_several, send.clone(), job)
                    async for event in receive:
                        await emit(event)

        async def produce_with_deadline(emit: Emit) -> None:
            try:
                with deadline(limit):
                    await produce(emit)
            except RequestTimeoutError as exc:  # the 200 is sent: say it here
                response = self.error_response(exc)
                assert response is not None
                await emit(json.loads(bytes(response.body)))
                await emit("[DONE]")

        return EventStream(produce_with_deadline)

    async def observe(
        self,
        job: Job,
        on_output: Callable[[RequestOutput], Awaitable[None]] | None,
    ) -> RequestOutput:
        """Run one job, recording latency metrics and, inside an HTTP request,
        its record (:mod:`~structllm.server.http.access`); its final output.

        The engine request is named after the HTTP request's id.
        """
        metrics = self.metrics
        record = current_record()
        start = time.monotonic()
        last = start
        first = True
        prompt = job.prompt
        timing = job.timing
        timing.start = start
        params = job.params
        if (
            self.config.enable_per_request_metrics
            and params.output_kind is OutputKind.FINAL
        ):
            # every step's output, so the first token's time is known (the
            # final output is the same either way)
            params = attrs.evolve(params, output_kind=OutputKind.DELTA)
        rid = None
        if record is not None:
            rid = record.engine_request_id(job.index)
            if record.prompt_chars and record.prompt is None:
                record.prompt = self.prompt_text(prompt)[: record.prompt_chars]
        s = self.slot.get().stream(
            prompt, params, request_id=rid, priority=job.priority
        )
        try:
            async with s:
                async for out in s:
                    now = time.monotonic()
                    if out.outputs[0].token_ids:
                        if timing.first is None:
                            timing.first = now
                        timing.last = now
                    if first:
                        metrics.ttft.observe(now - start)
                        first = False
                        if record is not None:
                            record.token()
                    else:
                        metrics.itl.observe(now - last)
                    if on_output is not None:
                        await on_output(out)
                    # from the end of this send: a slow client's writes are
                    # not the engine's latency
                    last = time.monotonic()
        finally:
            # also when cancelled (client gone, timeout): synchronous, no await
            result = s.final_output
            if result is not None:
                timing.queue_time = result.queue_time
                timing.tokens = len(result.outputs[0].token_ids)
                metrics.record_finished(result, time.monotonic() - start)
                if record is not None:
                    record.finished(
                        job.index,
                        job.prompt_index,
                        len(result.prompt_token_ids),
                        len(result.token_ids),
                        result.finish_reason,
                    )
        assert result is not None
        return result


@attrs.frozen
class Chunks(Generic[_R]):
    """What the StreamFormats of the APIs share: request, id, common fields."""

    serving: Serving
    req: _R
    rid: str

    @property
    def include_usage(self) -> bool:
        return self.req.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.req.continuous_usage

    def head(self, usage: bodies.Usage | None) -> dict[str, Any]:
        """The fields of a chunk besides its choices."""
        head = self.serving.head(self.rid)
        if usage is not None:
            head["usage"] = usage
        return head

    def finish_fields(self, c: CompletionOutput) -> dict[str, Any]:
        """A streamed choice's ``token_ids`` if asked, ``stop_reason`` at the end."""
        extra: dict[str, Any] = {}
        if self.req.return_token_ids:
            extra["token_ids"] = list(c.token_ids)
        if c.finish_reason is not None:
            extra["stop_reason"] = c.stop_reason
        return extra


#: the X-Request-Timeout header's seconds, for the request being served
_header_timeout: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "structllm_header_timeout", default=None
)


def header_timeout(request: Request) -> float | None:
    """The ``X-Request-Timeout`` header: positive seconds, or None if absent."""
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequestError(
            f"X-Request-Timeout must be a positive number of seconds, not {raw!r:.40}",
            field="X-Request-Timeout",
        )
    return seconds
