"""What the scheduler takes and returns: its config, a step's work, its counts.

Plain values (attrs), no policy: :mod:`structllm.core.scheduler` decides,
the runner and the engine core read these.
"""

from __future__ import annotations

from typing import Literal

import attrs

from structllm.config import EngineConfig
from structllm.core.block_pool import BlockPoolStatistics
from structllm.core.request import Request
from structllm.errors import EngineConfigError
from structllm.settings import at_least

__all__ = [
    "ScheduledChunk",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStatistics",
    "hit_rate",
]


_ENGINE = attrs.fields(EngineConfig)


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """The scheduler's share of :class:`~structllm.config.EngineConfig`.

    Not a setting users pass: :class:`~structllm.core.engine_core.EngineCore`
    builds it from their ``EngineConfig`` and the model (``max_model_len``
    resolved), and the defaults are ``EngineConfig``'s, so each lives once.
    """

    max_model_len: int = attrs.field(validator=at_least(2))
    max_num_seqs: int = attrs.field(
        default=_ENGINE.max_num_seqs.default, validator=at_least(1)
    )
    max_num_batched_tokens: int = attrs.field(
        default=_ENGINE.max_num_batched_tokens.default, validator=at_least(1)
    )
    #: split prompts longer than the token budget over several steps
    enable_chunked_prefill: bool = attrs.field(
        default=_ENGINE.enable_chunked_prefill.default
    )
    #: reuse cached full blocks of earlier requests with the same prefix
    enable_prefix_caching: bool = attrs.field(
        default=_ENGINE.enable_prefix_caching.default
    )
    #: proposed tokens a decoding request may verify per step (0: none)
    num_speculative_tokens: int = attrs.field(default=0, validator=at_least(0))
    #: no proposals while more requests than this run (None: no limit)
    disable_by_batch_size: int | None = attrs.field(default=None, validator=at_least(1))
    #: within a priority: "edf", earliest deadline first; "fcfs", arrival
    scheduling_order: Literal["edf", "fcfs"] = attrs.field(
        default=_ENGINE.scheduling_order.default,
        validator=attrs.validators.in_(("edf", "fcfs")),
    )
    #: edf: a request without a deadline is due this long after it arrives
    deadline_starvation_s: float = attrs.field(
        default=_ENGINE.deadline_starvation_s.default,
        validator=at_least(0, above=True),
    )

    def __attrs_post_init__(self) -> None:
        if (
            not self.enable_chunked_prefill
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise EngineConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) without chunked prefill",
                field="max_num_batched_tokens",
            )


@attrs.frozen
class ScheduledChunk:
    """Run ``num_tokens`` tokens of ``request`` after ``context_len`` cached ones."""

    request: Request
    context_len: int
    num_tokens: int
    #: the chunk ends at the newest token, so a token is sampled after it
    samples: bool
    #: proposed tokens run after the chunk's own (the last ``len(...)`` of
    #: ``num_tokens``), to verify; only in a sampling decode chunk
    draft_token_ids: tuple[int, ...] = ()


@attrs.frozen
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]
    #: requests whose deadline passed, dropped (finished "abort") this step
    expired: tuple[Request, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        """Tokens run through the model, proposed ones included."""
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(c.draft_token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@attrs.frozen
class SchedulerStatistics:
    num_running: int
    num_waiting: int
    #: requests waiting because they were preempted (a subset of num_waiting)
    num_preempted: int
    total_preemptions: int
    blocks: BlockPoolStatistics
    #: tokens of admitted requests looked up in the prefix cache, ever
    prefix_cache_queries: int = 0
    #: of those, tokens found there (not computed)
    prefix_cache_hits: int = 0
    #: speculative decoding, ever: steps in which a request verified
    #: proposals, the tokens proposed, and those the model accepted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: requests dropped because their deadline passed, ever, and the tokens
    #: the model would still have run for them (at most: max_tokens bounds
    #: their decode)
    num_expired: int = 0
    expired_tokens_skipped: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits over queries, in tokens; 0.0 before any query."""
        return hit_rate(self.prefix_cache_hits, self.prefix_cache_queries)

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens; 0.0 before any proposal."""
        return hit_rate(self.num_accepted_tokens, self.num_draft_tokens)


def hit_rate(hits: int, queries: int) -> float:
    """``hits / queries``, 0.0 before any query."""
    return hits / queries if queries else 0.0
