"""Front-end settings of :meth:`AsyncLLM.open` (the core's are EngineConfig)."""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["FrontendConfig"]


@attrs.frozen(kw_only=True)
class FrontendConfig:
    """Front-end settings of :meth:`AsyncLLM.open` (engine settings are separate)."""

    #: where the core runs: a child process, or a thread of this one
    executor: Literal["process", "inline"] = "process"
    tokenizer: str | None = None
    #: refuse new requests with EngineOverloadedError once this many wait
    #: beyond what the core runs at once (max_num_seqs); None = no limit
    max_queued_requests: int | None = None
    #: seconds that leaving open() waits for in-flight requests
    shutdown_grace: float = 5.0
    heartbeat_interval: float = 1.0
    #: a core silent this long (no heartbeat, no step) is declared dead
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
    #: core has been silent this long; None = 3 heartbeat intervals (a
    #: step longer than this also reads as unhealthy until it ends)
    health_timeout: float | None = None
    #: test hook forwarded to the core ("raise_at_step:N", "hang_at_step:N",
    #: "exit_at_step:N") for its first ``fault_starts`` starts
    fault: str | None = None
    fault_starts: int = 1
