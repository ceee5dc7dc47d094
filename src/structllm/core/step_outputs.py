"""What one engine-core step reports: each request's news, and the step's.

:class:`~structllm.core.engine_core.EngineCore` runs the batch; these turn
what it ran into the wire's :class:`~structllm.core.request.StepOutput`:
prompt logprobs sent once (:func:`take_prompt_logprobs`), pooled rows
gathered over a prompt's chunks (:func:`add_pooled`) and finished into an
embedding (:func:`embedding_output`), and the step's timings and the
scheduler's counts (:func:`step_output`).
"""

from __future__ import annotations

import time

import numpy as np

from structllm.core.pooling import finish_embedding
from structllm.core.request import Request, RequestStepOutput, StepOutput
from structllm.core.scheduler import Scheduler, SchedulerOutput
from structllm.core.structured import RejectedRequest
from structllm.model.logprobs import TokenLogprobs

__all__ = ["add_pooled", "embedding_output", "step_output", "take_prompt_logprobs"]


def take_prompt_logprobs(req: Request) -> tuple[TokenLogprobs | None, ...] | None:
    """The prompt logprobs, once: with the request's first sampled token
    (the end of its prompt, so all are computed), then never again."""
    if not req.needs_prompt_logits:
        return None
    entries, req.prompt_logprobs = req.prompt_logprobs, []
    req.prompt_logprobs_sent = True
    return (None, *entries)


def add_pooled(req: Request, first: int, stop: int, rows: np.ndarray) -> None:
    """Take a step's pooled rows (see ``RunnerOutput.pooled``) into ``req``."""
    assert req.pooling is not None
    if req.pooling.method == "last":
        req.pooled = rows
    elif first == req.num_pooled:  # the next positions, in order
        req.pooled = rows if req.pooled is None else req.pooled + rows
        req.num_pooled = stop


def embedding_output(req: Request) -> RequestStepOutput:
    """A finished pooling request's one output: its embedding."""
    assert req.pooling is not None and req.pooled is not None
    pooled = req.pooled
    if req.pooling.method == "mean":
        pooled = pooled / len(req.prompt_token_ids)
    vector = finish_embedding(pooled, req.pooling)
    queue_s = None
    if req.first_scheduled_time is not None:
        queue_s = req.first_scheduled_time - req.arrival_time
    return RequestStepOutput(
        request_id=req.request_id,
        new_token_ids=(),
        finish_reason="stop",
        queue_s=queue_s,
        num_cached_tokens=req.num_cached_tokens,
        embedding=vector.astype("<f4").tobytes(),
    )


def step_output(
    s: Scheduler,
    outputs: tuple[RequestStepOutput, ...],
    sched: SchedulerOutput,
    start: float,
    schedule_s: float,
    forward_s: float = 0.0,
    sample_s: float = 0.0,
    *,
    rejected: tuple[RejectedRequest, ...] = (),
) -> StepOutput:
    """A step's :class:`StepOutput`: ``outputs``, its timings, and the
    scheduler's counts after it."""
    return StepOutput(
        outputs=outputs,
        num_batched_tokens=sched.num_batched_tokens,
        num_seqs=len(sched.chunks),
        preempted=sched.preempted,
        rejected=rejected,
        schedule_s=schedule_s,
        forward_s=forward_s,
        sample_s=sample_s,
        total_s=time.perf_counter() - start,
        num_running=len(s.running),
        num_waiting=len(s.waiting),
        blocks_used=s.pool.num_used,
        total_preemptions=s.total_preemptions,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_drafts=s.num_drafts,
        num_draft_tokens=s.num_draft_tokens,
        num_accepted_tokens=s.num_accepted_tokens,
        num_expired=s.num_expired,
        expired_tokens_skipped=s.expired_tokens_skipped,
    )
