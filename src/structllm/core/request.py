"""A request as the engine core sees it: token ids in, token ids out."""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs
import numpy as np

from structllm.core.block_pool import BlockHash
from structllm.outputs import FinishReason
from structllm.params import SamplingParams

__all__ = ["CoreRequest", "Request", "RequestStatus"]


@attrs.frozen(kw_only=True)
class CoreRequest:
    """What a front end submits to the core (also the wire message)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    #: ids that end the request unless ``params.ignore_eos``
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = 0.0
    #: requests with different salts never share prefix-cache blocks
    cache_salt: str | None = None


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
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority, then arrival order."""
        return (self.priority, self.sequence_number)
