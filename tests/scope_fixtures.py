"""A scheduler driven by hand, with a clock the test moves: for the tests of
deadlines, races and pins in the core (tests/test_deadlines.py,
tests/test_race.py, tests/test_pin.py, tests/test_scope_properties.py)."""

from __future__ import annotations

import itertools

import attrs
import numpy as np

from structllm.core.block_pool import BlockPool
from structllm.core.request import Request
from structllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from structllm.params import SamplingParams

__all__ = ["Clock", "HandScheduler"]

#: the fake model samples this token, never an EOS
TOKEN = 7


@attrs.define
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@attrs.define(eq=False)
class HandScheduler:
    """A :class:`Scheduler` over a small pool, stepped with a fake model
    that samples :data:`TOKEN`; every step audits the pool."""

    num_blocks: int = 16
    block_size: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    scheduling_order: str = "edf"
    deadline_starvation_s: float = 30.0
    clock: Clock = attrs.Factory(Clock)
    scheduler: Scheduler = attrs.field(init=False)
    #: request id -> the steps that ran it (prefill chunks and decodes)
    ran: dict[str, int] = attrs.Factory(dict)
    #: the request ids in the order they were first scheduled
    started: list[str] = attrs.Factory(list)
    _seq: itertools.count[int] = attrs.Factory(itertools.count)

    def __attrs_post_init__(self) -> None:
        config = SchedulerConfig(
            max_model_len=self.num_blocks * self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            scheduling_order=self.scheduling_order,  # type: ignore[arg-type]
            deadline_starvation_s=self.deadline_starvation_s,
        )
        pool = BlockPool(self.num_blocks, self.block_size)
        self.scheduler = Scheduler(config, pool, clock=self.clock)

    @property
    def pool(self) -> BlockPool:
        return self.scheduler.pool

    def add(
        self,
        request_id: str,
        prompt: tuple[int, ...] | int,
        *,
        max_tokens: int = 4,
        deadline: float | None = None,
        priority: int = 0,
        group: str | None = None,
        pin: bool = False,
    ) -> Request:
        """Queue a request (a prompt of n distinct tokens for an int n),
        arrived now, as ``EngineCore._admit`` builds it."""
        if isinstance(prompt, int):
            prompt = tuple(100 + len(self.ran) * 50 + i for i in range(prompt))
        seq = next(self._seq)
        req = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            eos_token_ids=frozenset(),
            priority=priority,
            arrival_time=self.clock.now,
            sequence_number=seq,
            max_new_tokens=max_tokens,
            generator=np.random.default_rng(seq),
            deadline=deadline,
            group=group,
            pin=pin,
        )
        self.scheduler.add_request(req)
        self.ran.setdefault(request_id, 0)
        return req

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        """One step: schedule, "run", record; the requests that finished."""
        out = self.scheduler.schedule()
        for chunk in out.chunks:
            rid = chunk.request.request_id
            if not self.ran[rid]:
                self.started.append(rid)
            self.ran[rid] += 1
        sampled = {c.request.request_id: [TOKEN] for c in out.chunks if c.samples}
        finished = self.scheduler.update_from_output(out, sampled)
        self.pool.audit()
        return out, finished

    def run_until_idle(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("the scheduler never went idle")
