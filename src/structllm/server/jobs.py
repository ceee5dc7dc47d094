"""The requests of one response: a :class:`Job` is one choice of one prompt,
with its :class:`JobTiming` (when its outputs came: vLLM's per-request
``metrics``); a :class:`StreamFormat` is how an API writes a stream's
chunks (:meth:`~structllm.server.serving.Serving.stream` runs the jobs)."""

from __future__ import annotations

from typing import Any, Protocol

import attrs
from pydantic import BaseModel

from structllm.engine.frontend.inputs import Prompt
from structllm.lora_request import LoRARequest
from structllm.outputs import RequestOutput
from structllm.params import SamplingParams
from structllm.server.protocol import bodies

__all__ = ["Job", "JobTiming", "StreamFormat"]


@attrs.define(eq=False)
class JobTiming:
    """When one job's outputs arrived (monotonic seconds), for vLLM's
    per-request ``metrics``;
    :meth:`~structllm.server.serving.Serving.observe` fills it in."""

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
    #: the LoRA adapter its ``model`` named (None: the base model)
    lora_request: LoRARequest | None = None


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
    def delta_event(
        self, job: Job, out: RequestOutput, usage: bodies.Usage | None
    ) -> dict[str, Any]:
        """``delta``'s chunk as the JSON object sent (the one event a token)."""
        ...

    def closing(
        self, usage: bodies.Usage, metrics: bodies.PerRequestMetrics | None
    ) -> BaseModel: ...
