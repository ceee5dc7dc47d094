"""A request as the engine core sees it: token ids in, token ids out.

:class:`CoreRequest` is the one shape of a submitted request: the offline
``LLM`` hands it to :class:`~structllm.core.engine_core.EngineCore` directly,
and the async front end sends the very same struct to the core process as a
msgspec frame (``structllm.engine.protocol``). It is a msgspec ``Struct`` so
that it needs no converter on either side; its ``params`` is the user-facing
attrs :class:`SamplingParams`, which msgspec encodes from its fields and
decodes through its ``__init__`` checks (the converters do not run on decode,
but the field types are enforced, so a decoded value is already normalised).

:class:`Request` is the scheduler's mutable state of an admitted request,
never a message.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import msgspec

from structllm.core.block_pool import BlockHash
from structllm.core.pooling import Pooling
from structllm.lora_request import LoRARequest
from structllm.model.logprobs import TokenLogprobs
from structllm.outputs import FinishReason
from structllm.params import SamplingParams

if TYPE_CHECKING:
    import numpy as np

    from structllm.structured.matcher import GrammarMatcher

__all__ = [
    "CoreRequest",
    "RejectedRequest",
    "Request",
    "RequestStatus",
    "RequestStepOutput",
    "StepOutput",
]


class CoreRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """What a front end submits to the core, in process and on the wire."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    #: ids that end the request unless ``params.ignore_eos``
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = 0.0
    #: requests with different salts never share prefix-cache blocks
    cache_salt: str | None = None
    #: the caller's deadline (``time.monotonic()`` of this machine): the core
    #: orders by it and drops the request once it passes (None: no deadline)
    deadline: float | None = None
    #: a race's name: ``AbortRequests(groups=[group])`` ends every member
    group: str | None = None
    #: on finishing, keep the prompt's full blocks cached and held, under this
    #: request's id, until an abort names it (``AsyncLLM.pin``)
    pin: bool = False
    #: an embedding request: prefilled, pooled, finished at the end of its
    #: prefill with ``RequestStepOutput.embedding`` (nothing is sampled)
    pooling: Pooling | None = None
    #: the LoRA adapter to run with (read on first use; None: the base model)
    lora_request: LoRARequest | None = None


class RejectedRequest(msgspec.Struct, frozen=True, array_like=True):
    """A request the core dropped before running it: its grammar was refused.

    The front end fails the request with ``InvalidRequestError(message,
    field=field)``, as for a refusal at ``add_request``.
    """

    request_id: str
    message: str
    field: str | None = None


class RequestStepOutput(msgspec.Struct, frozen=True, array_like=True):
    """What one step produced for one request (in process and on the wire)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    #: on a request's first output: seconds from arrival to first scheduled
    queue_s: float | None = None
    #: on a request's first output: prompt tokens read from the prefix cache
    #: (OpenAI's usage.prompt_tokens_details.cached_tokens)
    num_cached_tokens: int | None = None
    #: with the first sampled token of a request with ``prompt_logprobs``:
    #: one entry per prompt token, the first None (nothing predicts it)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    #: a pooling request's embedding, with its finish: float32, little-endian
    embedding: bytes | None = None


class StepOutput(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """One step's news, and the scheduler's state after it.

    The core process sends this very struct to the front end.
    """

    outputs: tuple[RequestStepOutput, ...]
    num_batched_tokens: int
    num_seqs: int
    preempted: tuple[str, ...] = ()
    #: requests dropped unrun because their grammar was refused
    rejected: tuple[RejectedRequest, ...] = ()
    #: seconds: scheduling, model forward (incl. logits), sampling, whole step
    schedule_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    total_s: float = 0.0
    #: scheduler snapshot after the step
    num_running: int = 0
    num_waiting: int = 0
    blocks_used: int = 0
    total_preemptions: int = 0
    #: prompt tokens this core has looked up in the prefix cache, and found
    #: (cumulative since it started; vLLM's prefix_cache_queries / hits)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: speculative decoding (cumulative since the core started): steps in
    #: which a request verified proposed tokens, the tokens proposed, and
    #: those the model accepted (acceptance rate: accepted / proposed)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: requests dropped because their deadline passed, and the tokens the
    #: model would still have run for them, at most (cumulative)
    num_expired: int = 0
    expired_tokens_skipped: int = 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@attrs.define(eq=False)
class Request:
    """Mutable scheduling state of one request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    priority: int
    arrival_time: float
    #: admission order; breaks priority ties first-come first-served
    sequence_number: int
    #: the most tokens this request may generate (max_tokens capped by context)
    max_new_tokens: int
    #: the request's own random stream (seeded from params.seed if given)
    generator: np.random.Generator
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = attrs.Factory(list)
    #: tokens whose K/V are in the cache (prefix of prompt + outputs)
    num_computed_tokens: int = 0
    block_ids: list[int] = attrs.Factory(list)
    num_preemptions: int = 0
    #: when the request was first scheduled (time.monotonic), for queue time
    first_scheduled_time: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    cache_salt: str | None = None
    #: chained hash of each full block of prompt + outputs (prefix caching on)
    block_hashes: list[BlockHash] = attrs.Factory(list)
    #: leading entries of block_ids already offered to the prefix cache
    num_cached_blocks: int = 0
    #: prompt tokens taken from the prefix cache when first scheduled
    num_cached_tokens: int | None = None
    #: structured output: the grammar state, which has accepted exactly
    #: ``output_token_ids`` (None when unconstrained or still compiling)
    grammar: GrammarMatcher | None = None
    #: its grammar is compiling; the scheduler leaves it waiting meanwhile
    waiting_for_grammar: bool = False
    #: params.prompt_logprobs: the entries of prompt tokens 1, 2, ... computed
    #: so far (kept across preemption, so none is computed twice), until
    #: they are sent with the first sampled token
    prompt_logprobs: list[TokenLogprobs] = attrs.Factory(list)
    prompt_logprobs_sent: bool = False
    #: the caller's deadline (time.monotonic); past it the core drops it
    deadline: float | None = None
    #: the scheduling order's due time (see Scheduler.add_request)
    due: float = 0.0
    group: str | None = None
    pin: bool = False
    #: speculative decoding: the most tokens to propose next (adapts to how
    #: many were accepted; None: the configured number), decode steps to
    #: run without proposals, and verifications in a row that accepted none
    spec_window: int | None = None
    spec_skip: int = 0
    spec_misses: int = 0
    #: an embedding request's pooling, its defaults resolved (None: generates)
    pooling: Pooling | None = None
    #: mean pooling: the sum of the hidden rows of prompt positions
    #: ``[0, num_pooled)`` (float64, kept across preemption so no position
    #: counts twice); last pooling: the last position's row
    pooled: np.ndarray | None = None
    num_pooled: int = 0
    #: its LoRA adapter's id (0: none) and prefix-cache key (LoRAManager)
    lora_id: int = 0
    lora_key: bytes | None = None

    @property
    def needs_every_position(self) -> bool:
        """It must compute its whole prompt, no prefix-cache hits: prompt
        logprobs still owed, or mean pooling (a cached block has no hidden
        states)."""
        return self.needs_prompt_logits or (
            self.pooling is not None and self.pooling.method == "mean"
        )

    @property
    def needs_prompt_logits(self) -> bool:
        """Its prompt logprobs are still to compute or send: it must compute
        its whole prompt (no prefix-cache hits)."""
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, stop: int) -> Sequence[int]:
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return [*self.prompt_token_ids[start:], *self.output_token_ids[: stop - p]]

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Lower runs first: priority, due time, then arrival order."""
        return (self.priority, self.due, self.sequence_number)

    def past_deadline(self, now: float) -> bool:
        return self.deadline is not None and self.deadline <= now

    @property
    def num_tokens_left(self) -> int:
        """Tokens the model would still run for it, at most: the pending
        ones and one per output it may still sample after the next."""
        outputs_left = self.max_new_tokens - len(self.output_token_ids) - 1
        return self.num_pending_tokens + max(0, outputs_left)

    def check_stop(self, token: int) -> tuple[FinishReason, int | None] | None:
        """Whether ``token``, just appended to the outputs, ends the request:
        (finish reason, stop reason), or None."""
        params = self.params
        n = len(self.output_token_ids)
        if n >= params.min_tokens:
            if token in params.stop_token_ids:
                return "stop", token
            if token in self.eos_token_ids and not params.ignore_eos:
                return "stop", None
        if self.grammar is not None and self.grammar.is_terminated():
            # EOS accepted, or nothing but EOS may follow: neither min_tokens
            # nor ignore_eos extends a complete structured output
            return "stop", None
        if n >= self.max_new_tokens:
            return "length", None
        return None
