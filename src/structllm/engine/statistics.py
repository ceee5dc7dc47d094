"""What :meth:`AsyncLLM.statistics` returns: one snapshot of the engine."""

from __future__ import annotations

import attrs

from structllm.core.scheduler_types import hit_rate

__all__ = ["EngineStatistics"]


@attrs.frozen(kw_only=True)
class EngineStatistics:
    """A snapshot; the counts come from the core's latest report."""

    live_requests: int
    running: int
    waiting: int
    blocks_used: int
    num_blocks: int
    total_preemptions: int
    restarts: int
    ready: bool
    dead: bool
    #: the pid of the core process (this process's, for the inline executor;
    #: replica 0's with data parallelism: see ``replicas``)
    core_pid: int | None
    #: the KV cache's size in bytes (0 before a core is up)
    kv_cache_bytes: int = 0
    #: the core process's peak resident memory in bytes (model, KV cache,
    #: buffers), as of its last heartbeat or the step that left it idle;
    #: with tensor parallelism, rank 0's process only. 0 before a core is up.
    core_peak_rss_bytes: int = 0
    #: seconds since the core was last heard from (None: no core)
    silent_for: float | None = None
    #: ready, not dead, and heard from within the health timeout
    healthy: bool = False
    #: prompt tokens looked up in the prefix cache, and found there (since
    #: open(), over every core start)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: speculative decoding (``speculative_config``): verification steps of a
    #: request with proposals, tokens proposed, and proposed tokens accepted
    #: (since open(), over every core start)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    #: requests the core dropped because their deadline passed, and the
    #: tokens it would still have run for them, at most (since open())
    deadline_expired_requests: int = 0
    deadline_skipped_tokens: int = 0
    #: each replica's own snapshot (its ``live_requests``: those placed on
    #: it); the counts above are their sums, ``ready`` and ``healthy`` true
    #: when any replica is, ``dead`` when all are
    replicas: tuple[EngineStatistics, ...] = ()

    @property
    def core_pids(self) -> tuple[int | None, ...]:
        """Every replica's core pid (None for one restarting)."""
        return tuple(r.core_pid for r in self.replicas)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Found / looked-up prompt tokens; 0.0 before any lookup."""
        return hit_rate(self.prefix_cache_hits, self.prefix_cache_queries)

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted / proposed tokens; 0.0 before any proposal."""
        return hit_rate(
            self.spec_decode_num_accepted_tokens, self.spec_decode_num_draft_tokens
        )
