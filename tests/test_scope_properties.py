"""Deadlines, races, pins and aborts mixed at random leave nothing behind.

Two levels:

- the scheduler, driven by a Hypothesis state machine over a small pool with
  a clock it moves: requests with and without deadlines over a few shared
  prefixes, races (groups), pins, aborts of requests, groups and pins, time
  passing, steps. After every rule the pool's books balance; a held pin's
  blocks are referenced and still found by their hashes (never evicted);
  no chunk runs a request past its deadline. At the end, with every pin
  released and every request aborted or run out, every block is free.
- ``AsyncLLM`` on both loops (Hypothesis drives ``anyio.run``, as in
  tests/test_async_properties.py): random concurrent mixes of streams under
  deadlines, races, pin blocks with requests inside, aborts and early exits;
  once all are done the core holds no request, no pin, no block.
"""

from __future__ import annotations

import functools
import os

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)

from structllm import InvalidRequestError, RequestOutput, SamplingParams
from structllm.core.request import Request
from structllm.engine.frontend.async_llm import AsyncLLM
from tests.core_record import assert_core_holds_nothing
from tests.scope_fixtures import HandScheduler

#: prompts over shared prefixes: 4-token blocks, so 0-3 full shared blocks
BASES = ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), (1, 2, 3, 4, 20, 21, 22, 23, 24))


class ScopedScheduler(RuleBasedStateMachine):
    """The scheduler under deadlines, groups and pins."""

    requests = Bundle("requests")
    pins = Bundle("pins")

    def __init__(self) -> None:
        super().__init__()
        self.h = HandScheduler(num_blocks=12, block_size=4, max_num_batched_tokens=8)
        #: pin id -> the hashes its blocks are found under
        self.held: dict[str, list[bytes]] = {}
        self.names = iter(range(1 << 30))

    @rule(
        target=requests,
        base=st.sampled_from(BASES),
        cut=st.integers(1, 12),
        tail=st.integers(0, 6),
        deadline=st.none() | st.floats(0.0, 10.0),
        group=st.none() | st.sampled_from(["a", "b"]),
        max_tokens=st.integers(1, 6),
    )
    def add(
        self,
        base: tuple[int, ...],
        cut: int,
        tail: int,
        deadline: float | None,
        group: str | None,
        max_tokens: int,
    ) -> str:
        rid = f"r{next(self.names)}"
        prompt = (*base[:cut], *range(200, 200 + tail))
        self.h.add(rid, prompt, max_tokens=max_tokens, deadline=deadline, group=group)
        return rid

    @rule(target=pins, base=st.sampled_from(BASES), cut=st.integers(4, 12))
    def pin(self, base: tuple[int, ...], cut: int) -> str:
        rid = f"p{next(self.names)}"
        held = len(self.h.pool.pinned_blocks()) + sum(
            len(r.prompt_token_ids) // 4
            for r in self.h.scheduler.requests.values()
            if r.pin
        )
        if held + cut // 4 <= 6:  # the core's cap: half the pool
            self.h.add(rid, base[:cut], max_tokens=1, pin=True)
        return rid

    @rule(rid=consumes(requests))
    def abort(self, rid: str) -> None:
        self.h.scheduler.abort_requests([rid])

    @rule(group=st.sampled_from(["a", "b"]))
    def abort_group(self, group: str) -> None:
        s = self.h.scheduler
        s.abort_requests([r for r, q in s.requests.items() if q.group == group])
        assert not any(q.group == group for q in s.requests.values())

    @rule(rid=consumes(pins))
    def unpin(self, rid: str) -> None:
        self.h.scheduler.abort_requests([rid])
        self.held.pop(rid, None)
        assert not self.h.pool.is_pinned(rid)

    @rule(seconds=st.floats(0.0, 3.0))
    def wait(self, seconds: float) -> None:
        self.h.clock.now += seconds

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            now = self.h.clock.now
            out, finished = self.h.step()
            for chunk in out.chunks:
                d = chunk.request.deadline
                assert d is None or d > now, "a request ran past its deadline"
            for req in finished:
                self._note_pin(req)

    def _note_pin(self, req: Request) -> None:
        if req.pin and self.h.pool.is_pinned(req.request_id):
            full = len(req.prompt_token_ids) // 4
            self.held[req.request_id] = req.block_hashes[:full]

    @invariant()
    def pins_are_never_evicted(self) -> None:
        pool = self.h.pool
        for hashes in self.held.values():
            blocks = pool.lookup(hashes)
            assert len(blocks) == len(hashes), "a held pin's block was evicted"
            assert all(pool.ref_count(b) >= 1 for b in blocks)

    def teardown(self) -> None:
        s = self.h.scheduler
        s.abort_requests(list(s.requests))
        s.abort_requests(list(self.held))
        assert self.h.pool.num_used == 0 and not s.has_unfinished_requests()
        self.h.pool.audit()


def test_scoped_scheduler() -> None:
    run_state_machine_as_test(
        ScopedScheduler,
        settings=settings(max_examples=200, stateful_step_count=30, deadline=None),
    )


# -- AsyncLLM -----------------------------------------------------------------

PROMPT = [(5 * i + 3) % 250 for i in range(40)]
FATES = ("deadline", "race", "pin", "abort", "leave", "plain")

fate = st.tuples(st.sampled_from(FATES), st.integers(1, 3), st.floats(0.0, 0.05))


async def run_fate(llm: AsyncLLM, i: int, kind: str, k: int, seconds: float) -> None:
    params = SamplingParams(max_tokens=6 * k, ignore_eos=True, seed=i)
    prompt = [*PROMPT[: 8 * k], i]
    if kind == "deadline":
        with anyio.move_on_after(seconds):
            await llm.complete(prompt, params)
    elif kind == "race":

        def accept(out: RequestOutput) -> bool:
            return len(out.outputs[0].token_ids) % 2 == 0

        with anyio.move_on_after(seconds * 4):
            await llm.race(prompt, params, n=k, accept=accept)
    elif kind == "pin":
        try:
            with anyio.move_on_after(seconds * 4):
                async with llm.pin(PROMPT[: 16 * k]):
                    await llm.complete([*PROMPT[: 16 * k], i], params)
        except InvalidRequestError as exc:  # over the cap: refused cleanly
            assert exc.field == "pin"
    elif kind == "abort":
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                functools.partial(llm.complete, prompt, params, request_id=f"a{i}")
            )
            await anyio.sleep(seconds)
            await llm.abort(f"a{i}")
    elif kind == "leave":
        async with llm.stream(prompt, params) as s:
            async for _ in s:
                if k == 1:
                    break
    else:
        await llm.complete(prompt, params)


async def mix(fates: list[tuple[str, int, float]]) -> None:
    async with AsyncLLM.open(
        "tiny-random",
        executor="inline",
        show_progress=False,
        max_model_len=128,
        block_size=16,
        num_blocks=24,
        max_num_batched_tokens=32,
        max_pinned_fraction=0.25,
    ) as llm:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i, (kind, k, seconds) in enumerate(fates):
                    tg.start_soon(run_fate, llm, i, kind, k, seconds)
        await assert_core_holds_nothing(llm)
        state = (await llm.inspect_cores())[0]
        assert state is not None and state.pins == []
        # and the front end places nothing on the replica any more
        assert [r.live_requests for r in llm.statistics().replicas] == [0]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(
    max_examples=int(os.environ.get("STRUCTLLM_ASYNC_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(fates=st.lists(fate, min_size=1, max_size=8))
def test_random_mixes_of_scopes_leave_nothing(
    backend: str, fates: list[tuple[str, int, float]]
) -> None:
    anyio.run(mix, fates, backend=backend)
