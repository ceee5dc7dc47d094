"""``async with llm.stream(...) as s: async for out in s``: one request's block."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

import anyio

from structllm.core.pooling import Pooling
from structllm.engine.frontend.inputs import PromptInput
from structllm.engine.frontend.output_processor import RequestState
from structllm.errors import unwrap_group
from structllm.lora_request import LoRARequest
from structllm.outputs import RequestOutput
from structllm.params import SamplingParams

if TYPE_CHECKING:
    from structllm.engine.frontend.async_llm import AsyncLLM

__all__ = ["RequestStream", "run_all_to_end", "run_to_end"]


class RequestStream:
    """``async with llm.stream(...) as s: async for out in s`` (see AsyncLLM.stream)."""

    def __init__(
        self,
        llm: AsyncLLM,
        prompt: PromptInput,
        params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        *,
        pooling: Pooling | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self._llm = llm
        self._pooling = pooling
        self._lora = lora_request
        self._prompt = prompt
        self._params = SamplingParams() if params is None else params
        #: known before anything is registered, so any request can be aborted
        self.request_id = request_id if request_id is not None else uuid.uuid4().hex
        self._priority = priority
        self._state: RequestState | None = None
        self._scope: anyio.CancelScope | None = None

    @property
    def finish_reason(self) -> str | None:
        return None if self._state is None else self._state.finish_reason

    @property
    def final_output(self) -> RequestOutput | None:
        """Everything generated so far, whatever the output kind."""
        return None if self._state is None else self._state.snapshot()

    async def __aenter__(self) -> RequestStream:
        self._state = await self._llm.submit(
            self._prompt,
            self._params,
            self.request_id,
            self._priority,
            pooling=self._pooling,
            lora_request=self._lora,
        )
        self._scope = anyio.CancelScope()
        self._scope.__enter__()
        self._state.mailbox.scope = self._scope
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._state is not None and self._scope is not None
        try:
            self._llm.release(self._state)
        finally:
            swallowed = self._scope.__exit__(exc_type, exc, tb)
        return swallowed

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._state is None:
            raise RuntimeError("use the stream inside `async with llm.stream(...)`")
        out = await self._state.mailbox.next()
        if out is None:
            raise StopAsyncIteration
        return out


async def run_to_end(stream: RequestStream) -> RequestOutput:
    """Consume ``stream``; its last output (everything so far if aborted)."""
    last = None
    async with stream:
        async for out in stream:
            last = out
    if last is None:  # aborted before it produced anything
        last = stream.final_output
    assert last is not None
    return last


async def run_all_to_end(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """:func:`run_to_end` on each stream, concurrently; the outputs in order.

    One failing cancels the others; its error is raised as itself (the
    first, if several failed together), not in an ``ExceptionGroup``.
    """
    outputs: list[RequestOutput | None] = [None] * len(streams)

    async def run(i: int) -> None:
        outputs[i] = await run_to_end(streams[i])

    try:
        async with anyio.create_task_group() as tg:
            for i in range(len(streams)):
                tg.start_soon(run, i)
    except BaseExceptionGroup as group:
        raise unwrap_group(group) from None
    return [out for out in outputs if out is not None]
