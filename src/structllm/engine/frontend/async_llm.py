"""``AsyncLLM``: the structured-concurrency front end of the engine.

    async with AsyncLLM.open("tiny") as llm:                  # trio or asyncio
        async with llm.stream("Hello", SamplingParams(max_tokens=32)) as s:
            async for out in s:
                print(out.outputs[0].text, end="")

This module is the public API; the work is split by job as vLLM splits it:

- :mod:`~structllm.engine.frontend.core_client` starts the engine core (a child
  process, :mod:`~structllm.engine.core_process`, or a thread), supervises
  and restarts it, and talks to it; :mod:`~structllm.engine.frontend.replicas`
  holds ``data_parallel_size`` of them, routes each request to one, and is
  the one relay of their step outputs to the output processor;
- :mod:`~structllm.engine.frontend.output_processor` turns the core's tokens into
  outputs (detokenising, stop strings) and delivers them to each request's
  one-slot mailbox; the offline ``LLM`` uses the same processor;
- :mod:`~structllm.engine.frontend.inputs` checks a request's arguments and builds
  the request the core takes (shared with ``LLM`` too);
- :mod:`~structllm.engine.frontend.scopes` holds races and pins, the
  requests whose scope the core knows beyond a deadline;
- :mod:`~structllm.engine.frontend.front_end` admits requests
  (:meth:`AsyncLLM.submit`, :meth:`AsyncLLM.release`: the public pair
  :class:`~structllm.engine.frontend.request_stream.RequestStream` and
  ``generate()`` are built on), ``AsyncLLM``'s base class;
- this module ties each request to whoever consumes it.

``open()`` owns one task group, which runs the client. Leaving ``open()``
stops admission, lets in-flight requests finish for ``shutdown_grace``
seconds, fails the rest with EngineDeadError, and stops the core: no task,
thread or process outlives the block.

Registration with the front end and submission to the core happen together,
synchronously, so cancellation cannot split them; releasing a request
(leaving its ``stream`` block for any reason) sends the abort synchronously
too, so no cleanup ever has to await under cancellation. The core frees the
request's KV blocks before its next step.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import attrs

from structllm.config import EngineConfig, FrontendConfig, split_fields
from structllm.core.pooling import PoolingMethod, pooling_request
from structllm.engine.frontend.front_end import FrontEnd
from structllm.engine.frontend.inputs import (
    PromptInput,
)
from structllm.engine.frontend.output_processor import (
    merge_choices,
)
from structllm.engine.frontend.request_stream import (
    RequestStream,
    run_all_to_end,
    run_to_end,
)
from structllm.engine.frontend.scopes import (
    PinnedPrefix,
    open_pin,
    run_race,
)
from structllm.engine.protocol import CoreState
from structllm.engine.statistics import EngineStatistics
from structllm.errors import EngineDeadError, unwrap_group
from structllm.lora_request import LoRARequest
from structllm.outputs import EmbeddingOutput, RequestOutput
from structllm.params import OutputKind, SamplingParams
from structllm.text.tokenizer import Tokenizer, load_tokenizer

__all__ = ["AsyncLLM", "EngineStatistics", "PinnedPrefix", "RequestStream"]

#: an embedding request's sampling parameters: it samples nothing, and its
#: one output is its last
_EMBED_PARAMS = SamplingParams(max_tokens=1, output_kind=OutputKind.FINAL)


class AsyncLLM(FrontEnd):
    """The async engine. Build it with :meth:`open`; see the module docstring."""

    # ------------------------------------------------------------------ open

    @classmethod
    def open(cls, model: str, **kwargs: Any) -> AbstractAsyncContextManager[AsyncLLM]:
        """Start an engine for ``model`` (a directory or a built-in name).

        Keyword arguments are the fields of :class:`EngineConfig` (engine:
        ``max_model_len``, ``num_blocks``, ...) and of :class:`FrontendConfig`
        (``executor``, ``shutdown_grace``, ``max_restarts``, ...). Startup
        errors raise from ``open`` itself: ModelLoadError for a bad
        checkpoint, EngineConfigError for settings that cannot work (as
        ``LLM`` raises them).
        """
        engine_kw, front_kw = split_fields(
            kwargs, EngineConfig, FrontendConfig, caller="AsyncLLM.open()"
        )
        return cls._open(
            EngineConfig(model=str(model), **engine_kw),
            FrontendConfig(**front_kw),
            None,
        )

    @classmethod
    def from_config(
        cls,
        engine: EngineConfig,
        front: FrontendConfig | None = None,
        *,
        tokenizer: Tokenizer | None = None,
    ) -> AbstractAsyncContextManager[AsyncLLM]:
        """:meth:`open` for settings already built as config objects;
        ``tokenizer``: one already loaded, in place of loading
        ``front.tokenizer`` (or the model's)."""
        return cls._open(engine, front or FrontendConfig(), tokenizer)

    @classmethod
    @asynccontextmanager
    async def _open(
        cls, engine: EngineConfig, front: FrontendConfig, tokenizer: Tokenizer | None
    ) -> AsyncIterator[AsyncLLM]:
        if tokenizer is None:
            tokenizer = load_tokenizer(front.tokenizer or engine.model)
        llm = cls(engine, front, tokenizer)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(llm._client.run)
                try:
                    yield llm
                finally:
                    with anyio.CancelScope(shield=True):
                        await llm._shutdown()
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # Error contract: a startup failure (ModelLoadError,
            # EngineConfigError, EngineDeadError) or an exception from the
            # caller's own block comes out unwrapped; several at once (an
            # internal failure too) stay a group.
            exc = unwrap_group(group, sole=True)
            if exc is group:
                raise
            exc.__suppress_context__ = True
            raise exc  # noqa: B904 - the group is only a wrapper here

    # ------------------------------------------------------------ public API

    def stream(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """A request as an async context manager yielding an async iterator.

        Leaving the block early, a deadline, cancellation of the task, or
        :meth:`abort` ends the request; ``finish_reason`` is then ``"abort"``.
        Raises InvalidRequestError / EngineOverloadedError at entry, and
        EngineDeadError at entry or while iterating if the engine dies.
        ``lora_request``: run with that LoRA adapter (``enable_lora``).
        """
        return RequestStream(
            self, prompt, params, request_id, priority, lora_request=lora_request
        )

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM-style async generator. Close it deterministically::

            async with contextlib.aclosing(llm.generate(p, sp)) as agen:
                async for out in agen: ...

        It holds no cancel scope across ``yield`` (that would break
        structured concurrency); closing it releases the request.
        """
        state = await self.submit(
            prompt,
            SamplingParams() if params is None else params,
            request_id if request_id is not None else uuid.uuid4().hex,
            priority,
            lora_request=lora_request,
        )
        try:
            while (out := await state.mailbox.next()) is not None:
                yield out
        finally:
            self.release(state)

    async def complete(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutput:
        """Run a request to the end and return only its final output.

        With ``params.n`` > 1 the samples run as n requests (ids
        ``{request_id}-{i}``) sharing the prompt's KV blocks, and come back
        as one output; ``abort(request_id)`` ends them all.
        """
        params = attrs.evolve(
            SamplingParams() if params is None else params, output_kind=OutputKind.FINAL
        )
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if params.n == 1:
            stream = self.stream(
                prompt,
                params,
                request_id=rid,
                priority=priority,
                lora_request=lora_request,
            )
            return await run_to_end(stream)
        samples = [
            self.stream(
                prompt,
                params.for_choice(i),
                request_id=f"{rid}-{i}",
                priority=priority,
                lora_request=lora_request,
            )
            for i in range(params.n)
        ]
        # while they run, abort(rid) finds the samples under rid
        with self.samples_under(rid, [s.request_id for s in samples]):
            return merge_choices(await run_all_to_end(samples))

    async def embed(
        self,
        prompt: PromptInput,
        *,
        pooling: PoolingMethod | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> EmbeddingOutput:
        """The embedding of ``prompt``: its last hidden states pooled.

        ``pooling`` (``"last"`` token or ``"mean"`` of every position) and
        ``normalize`` (to unit length) default to what the checkpoint's
        sentence-transformers config says (last token, normalised, without
        one); ``dimensions`` keeps the first values (Matryoshka), normalised
        after. The request is prefilled through the same scheduler as any
        other and finished at the end of its prefill; its KV blocks go back
        at once. Cancelling the caller, or ``abort(request_id)``, ends it
        like any request (an aborted one returns without an embedding).
        ``lora_request``: pool the hidden states under that LoRA adapter.
        """
        spec = pooling_request(pooling, normalize, dimensions)
        stream = RequestStream(
            self,
            prompt,
            _EMBED_PARAMS,
            request_id,
            priority,
            pooling=spec,
            lora_request=lora_request,
        )
        return EmbeddingOutput.from_request_output(await run_to_end(stream))

    async def race(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        n: int,
        accept: Callable[[RequestOutput], bool] | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestOutput | None:
        """``n`` samples of ``prompt`` at once (seeds ``seed + i``, ids
        ``{request_id}-{i}``); the first to finish that ``accept`` takes (it
        gets each finished sample's final output, "stop" or "length";
        default: any), the others ended before the core's next step; None
        if none is taken. A cancelled caller, an ``accept`` that raises, or
        ``abort(request_id)`` ends all (:mod:`~structllm.engine.frontend.scopes`).
        """
        rid = request_id if request_id is not None else uuid.uuid4().hex
        params = SamplingParams() if params is None else params
        return await run_race(self, prompt, params, n, accept, rid, priority)

    def pin(
        self, prompt: PromptInput, *, request_id: str | None = None
    ) -> AbstractAsyncContextManager[PinnedPrefix]:
        """``async with llm.pin(prefix) as pinned:`` prefill ``prefix`` once and
        keep its full KV blocks cached, never evicted, for the block; leaving
        it by any path releases them before the core's next step. Beyond
        ``max_pinned_fraction`` of the blocks, InvalidRequestError (``pin``)."""
        rid = request_id if request_id is not None else uuid.uuid4().hex
        return open_pin(self, prompt, rid)

    async def abort(self, request_id: str) -> None:
        """End ``request_id`` now: cancels its stream block; idempotent."""
        for sample in self._samples.get(request_id, ()):
            await self.abort(sample)
        state = self._processor.get(request_id)
        if state is not None:
            # cancel first: a consumer woken by the release alone would see
            # a normal end of stream and run on inside its block
            scope = state.mailbox.scope
            if scope is not None:
                scope.cancel()
            self.release(state)
        await anyio.lowlevel.checkpoint()

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine has died for good."""
        if self._client.dead is not None:
            raise self._client.new_dead_error()
        await anyio.lowlevel.checkpoint()

    def statistics(self) -> EngineStatistics:
        return self._client.statistics(live_requests=len(self._processor))

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; return how many were forgotten.

        Blocks in use stay with their requests (and are not cached again
        when freed); pinned prefixes stay cached. Raises EngineDeadError if
        the core dies first.
        """
        return await self._client.reset_prefix_cache()

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read a LoRA adapter ahead of the requests that name it (they
        read it on first use otherwise); True when it was new. A bad one
        raises ModelLoadError naming the file and tensor; the engine serves on."""
        return await self._client.add_lora(lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload adapter ``lora_id``; requests running with it finish with
        it (docs/cancellation.md). False when it was not loaded."""
        return await self._client.remove_lora(lora_id)

    async def inspect_cores(self) -> tuple[CoreState | None, ...]:
        """Each replica core's own record of its requests and KV blocks.

        Asked of the core in order with everything this front end sent it,
        and answered before its next step: a request released before the
        call is gone from ``request_ids`` (the core's ids, ``{request_id}#n``)
        and its blocks are back in the answer, or the abort never reached
        the core. None for a replica dead for good. For tests and debugging;
        :meth:`statistics` is the cheap view.
        """
        return await self._client.inspect()

    async def wait_statistics(
        self, predicate: Callable[[EngineStatistics], bool]
    ) -> EngineStatistics:
        """Wait until a fresh snapshot satisfies ``predicate``; return it.

        The core reports after every step and whenever it goes idle, so
        ``wait_statistics(lambda s: s.blocks_used == 0)`` returns as soon as
        aborted requests' blocks are back. Bound it with a deadline.
        """
        while not predicate(stats := self.statistics()):
            await self._client.wait_changed()
        return stats

    async def wait_dead(self) -> None:
        """Wait until the engine has died for good (``statistics().dead``).

        Unlike ``wait_statistics(lambda s: s.dead)``, nothing wakes it before
        then: a server waits on this for as long as it serves.
        """
        await self._client.wait_dead()

    # -------------------------------------------------------------- shutdown

    async def _shutdown(self) -> None:
        self._client.begin_shutdown()
        with anyio.move_on_after(self.config.shutdown_grace):
            while len(self._processor):
                await self._idle_event.wait()
        self._processor.fail_all(
            lambda: EngineDeadError("the engine shut down before the request finished")
        )
        self._client.send_shutdown()
