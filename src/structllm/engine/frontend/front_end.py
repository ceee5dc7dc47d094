"""``FrontEnd``: what :class:`~structllm.engine.frontend.async_llm.AsyncLLM`
stands on, one request at a time.

It holds the front end's state (the live requests' output processor, the
cores behind their replica set, the samples a caller's id names) and the
primitives every shape of request is built from: :meth:`FrontEnd.submit`
(register a request and send it to a core, with nothing awaited between the
two) and :meth:`FrontEnd.release` (synchronous: safe under cancellation), the
admission checks before them, and what the loaded model says (context
length, vocabulary, the prompt byte cap). ``AsyncLLM`` adds the public API
(open, stream, generate, complete, embed, race, pin, abort) and shutdown;
:mod:`~structllm.engine.frontend.scopes` builds races and pins on the seams
here (:meth:`FrontEnd.samples_under`, :meth:`FrontEnd.end_group`,
:meth:`FrontEnd.drop`, :meth:`FrontEnd.unpin_nowait`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import anyio
import msgspec

from structllm.config import EngineConfig, FrontendConfig
from structllm.core.pooling import Pooling
from structllm.engine.frontend.core_client import health_timeout
from structllm.engine.frontend.inputs import (
    Admission,
    PromptInput,
    check_for_model,
    check_overload,
    process_inputs,
    prompt_byte_cap,
)
from structllm.engine.frontend.output_processor import OutputProcessor, RequestState
from structllm.engine.frontend.replicas import ReplicaSet
from structllm.engine.frontend.scopes import core_deadline
from structllm.engine.protocol import AbortRequests, Ready
from structllm.errors import EngineDeadError, InvalidRequestError
from structllm.lora_request import LoRARequest
from structllm.params import SamplingParams
from structllm.text.tokenizer import Tokenizer

__all__ = ["FrontEnd"]


class FrontEnd:
    """The front end's state and its one-request primitives (see the module
    docstring); :class:`~structllm.engine.frontend.async_llm.AsyncLLM` is
    the class to use."""

    def __init__(
        self, engine: EngineConfig, front: FrontendConfig, tokenizer: Tokenizer
    ) -> None:
        self.engine_config = engine
        self.config = front
        self.tokenizer = tokenizer
        #: the live requests
        self._processor = OutputProcessor(on_idle=self._on_idle)
        #: the cores, and the one relay of their step outputs to the requests
        self._client = ReplicaSet(engine, front, self._processor)
        self._submissions = itertools.count()
        self._idle_event = anyio.Event()
        self._eos: frozenset[int] = frozenset(tokenizer.eos_token_ids)
        #: requests run as several samples (complete(n > 1), a race): id -> the
        #: samples' ids, so abort(id) finds them
        self._samples: dict[str, list[str]] = {}

    # ------------------------------------------------------ the loaded model

    @property
    def health_timeout(self) -> float:
        return health_timeout(self.config)

    @property
    def max_prompt_bytes(self) -> int | None:
        """The byte cap on prompts (None until the context length is known)."""
        info = self._client.info
        return prompt_byte_cap(
            self.config.max_prompt_bytes, None if info is None else info.max_model_len
        )

    @property
    def vocab_size(self) -> int:
        assert self._client.info is not None
        return self._client.info.vocab_size

    @property
    def max_model_len(self) -> int:
        assert self._client.info is not None
        return self._client.info.max_model_len

    # ------------------------------------------- seams for races and pins

    @contextmanager
    def samples_under(self, request_id: str, sample_ids: list[str]) -> Iterator[None]:
        """While the block runs, ``abort(request_id)`` ends ``sample_ids``
        (the samples of ``complete(n > 1)`` or of a race)."""
        self._samples[request_id] = sample_ids
        try:
            yield
        finally:
            del self._samples[request_id]

    def end_group(self, group: str, states: list[RequestState]) -> None:
        """Release a race's samples here and end them in the core with one
        message naming the group. Synchronous: safe under cancellation."""
        live = [s.core_id for s in states if self._processor.release(s)]
        if live:
            self._client.abort_group_nowait(group, live)

    def drop(self, state: RequestState) -> bool:
        """Release ``state`` here without telling the core (a pin's request,
        which :meth:`unpin_nowait` ends there); True if it was still live."""
        return self._processor.release(state)

    def unpin_nowait(self, core_id: str) -> None:
        """Release the pin ``core_id`` (or abort its prefill) in its core."""
        self._client.unpin_nowait(core_id)

    @property
    def block_size(self) -> int:
        """Tokens per KV block of the loaded model's cache."""
        assert self._client.info is not None
        return self._client.info.block_size

    # ------------------------------------------------ one request, by hand

    async def submit(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        *,
        group: str | None = None,
        pin: bool = False,
        pooling: Pooling | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestState:
        """Register a request and send it to a core; its state (``mailbox``
        of outputs, ``finish_reason``, ``snapshot()``) until :meth:`release`.

        What :meth:`stream` and :meth:`generate` are built on. After the
        prompt is parsed and the engine is ready, registration and
        submission happen without an await: cancellation cannot split them.
        Every state must be released, on every path.

        The caller's effective deadline (``anyio.current_effective_deadline``)
        goes with it: the core ranks waiting work by it and drops the request
        once it passes, before the scope's own abort arrives. ``group``: a
        race's name; ``pin``: keep its prompt's blocks once prefilled (see
        :mod:`~structllm.engine.frontend.scopes`); ``pooling``: an embedding
        request (see :meth:`embed`).
        """
        state, request = await process_inputs(
            prompt,
            params,
            request_id,
            priority,
            self.tokenizer,
            max_bytes=self.max_prompt_bytes,
            admit=self._admit,
        )
        # No await since _admit's checks: registered and submitted, or neither.
        request = msgspec.structs.replace(
            request,
            deadline=core_deadline(),
            group=group,
            pin=pin,
            pooling=pooling,
            lora_request=lora_request,
        )
        self._client.submit_nowait(request)
        self._processor.add(state)
        return state

    async def _admit(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> Admission:
        """Wait for a ready core, then check without an await that the engine
        takes the request (see :func:`process_inputs`)."""
        await self._client.wait_ready()
        info = self.check_admission(prompt_token_ids, params=params)
        if self._processor.get(request_id) is not None:
            raise InvalidRequestError(
                f"request_id {request_id!r} is already in use by a live request",
                field="request_id",
            )
        # the id the core sees: unique per submission, so a caller's id can be
        # reused at once without a late output for the old request landing here
        return Admission(
            core_id=f"{request_id}#{next(self._submissions)}",
            eos_token_ids=self._eos | frozenset(info.eos_token_ids),
        )

    def check_admission(
        self,
        prompt_token_ids: Sequence[int],
        count: int = 1,
        *,
        params: SamplingParams | None = None,
    ) -> Ready:
        """Raise now what submitting ``count`` requests for this prompt would.

        EngineDeadError when dead, shutting down or restarting;
        InvalidRequestError for a prompt the model cannot take or a refused
        structured-output spec (a new one is checked on the loop, 0.1-2 ms;
        ``inputs.check_structured_outputs_off_loop`` checks it in a thread);
        EngineOverloadedError when admission control would refuse. Servers
        call it before promising a streaming response.
        """
        self._client.check_admitting()
        info = self._client.info
        if not self._client.ready or info is None:
            raise EngineDeadError("the engine core is restarting")
        check_for_model(
            prompt_token_ids,
            params,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
        )
        check_overload(
            len(self._processor),
            count,
            max_num_seqs=self._client.max_num_seqs,
            max_queued_requests=self.config.max_queued_requests,
        )
        return info

    def release(self, state: RequestState) -> None:
        """The consumer is done with ``state``: abort it in the core if
        unfinished. Synchronous (no checkpoint): safe under cancellation."""
        if self._processor.release(state):
            self._client.send_nowait(AbortRequests([state.core_id]))

    def _on_idle(self) -> None:
        self._idle_event.set()
        self._idle_event = anyio.Event()
