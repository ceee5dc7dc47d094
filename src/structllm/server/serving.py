"""The serving base: what every endpoint does around its own logic.

:class:`Serving` holds the engine slot, the configuration and the metrics,
and guards each request (:class:`~structllm.server.base.ServingBase`: the
body, the disconnect watcher, the time limit, the error responses, the
checks and fields the endpoints share). ``run_to_end()`` and ``stream()``
run the requests of one response (prompts times ``n``, each a
:class:`~structllm.server.jobs.Job`), the latter as server-sent events
whose chunks a :class:`~structllm.server.jobs.StreamFormat` writes (each
API's is a :class:`Chunks`); ``observe()`` runs one, recording its latency
metrics and timings. :mod:`~structllm.server.completions.serving` and
:mod:`~structllm.server.chat.serving` are the endpoints.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import anyio
import attrs
from anyio.streams.memory import MemoryObjectSendStream

from structllm.config import ServerConfig
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.errors import InvalidRequestError, unwrap_group
from structllm.lora_request import LoRARequest
from structllm.outputs import CompletionOutput, RequestOutput
from structllm.params import OutputKind
from structllm.server.base import EngineSlot, ServingBase
from structllm.server.http.access import current_record
from structllm.server.http.errors import RequestTimeoutError
from structllm.server.http.sse import Emit, EventStream, deadline
from structllm.server.jobs import Job, StreamFormat
from structllm.server.protocol import bodies
from structllm.server.protocol.constraints import rename_field
from structllm.server.protocol.sampling import SamplingRequest

#: with EngineSlot (server/base.py), Job (server/jobs.py) and ServerConfig
#: (config.py): the names every endpoint takes from here
__all__ = ["Chunks", "EngineSlot", "Job", "ServerConfig", "Serving", "StreamFormat"]

_R = TypeVar("_R", bound=SamplingRequest)


@attrs.define(eq=False)
class Serving(ServingBase):
    """The base of every endpoint's serving: :class:`ServingBase`'s guard and
    checks, and running the requests of one response, whole or streamed."""

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
                await emit(fmt.delta_event(job, o, running_usage()))

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
            prompt,
            params,
            request_id=rid,
            priority=job.priority,
            lora_request=job.lora_request,
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
    #: the request's LoRA adapter, named as its ``model``
    adapter: LoRARequest | None = attrs.field(default=None, kw_only=True)

    @property
    def include_usage(self) -> bool:
        return self.req.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.req.continuous_usage

    def head(self, usage: bodies.Usage | None) -> dict[str, Any]:
        """The fields of a chunk besides its choices."""
        head = self.serving.head(self.rid, self.adapter)
        if usage is not None:
            head["usage"] = usage
        return head

    def plain_chunk(self, kind: str, choice: dict[str, Any]) -> dict[str, Any]:
        """A streamed chunk of one choice and no usage as the JSON object sent,
        keys in the models' order (the ``delta_event`` fast paths)."""
        head = self.head(None)
        return {
            "id": head["id"],
            "object": kind,
            "created": head["created"],
            "model": head["model"],
            "system_fingerprint": head["system_fingerprint"],
            "choices": [choice],
        }

    def finish_fields(self, c: CompletionOutput) -> dict[str, Any]:
        """A streamed choice's ``token_ids`` if asked, ``stop_reason`` at the end."""
        extra: dict[str, Any] = {}
        if self.req.return_token_ids:
            extra["token_ids"] = list(c.token_ids)
        if c.finish_reason is not None:
            extra["stop_reason"] = c.stop_reason
        return extra
