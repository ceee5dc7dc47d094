"""Races: k samples of one prompt, the first accepted returned, the others
ended in the core before its next step by one message naming the group."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest

from structllm import InvalidRequestError, RequestOutput, SamplingParams
from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest
from structllm.engine.frontend.async_llm import AsyncLLM
from tests.core_record import assert_core_holds_nothing

ENGINE = {"max_model_len": 256, "num_blocks": 64, "block_size": 16}
PROMPT = [(7 * i + 2) % 250 for i in range(40)]
#: sampled freely, each step has a 1 in 8 chance to stop: the samples
#: stop at different steps, long before max_tokens
SPREAD = SamplingParams(
    temperature=1.0, seed=11, max_tokens=200, stop_token_ids=list(range(0, 256, 8))
)


def test_aborting_a_group_ends_every_member_in_the_core() -> None:
    core = EngineCore(EngineConfig(model="tiny-random", **ENGINE))
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    for i in range(3):
        core.add_request(
            CoreRequest(
                request_id=f"g-{i}",
                prompt_token_ids=tuple(PROMPT),
                params=params,
                group="g",
            )
        )
    core.add_request(
        CoreRequest(request_id="other", prompt_token_ids=(1, 2), params=params)
    )
    core.step()
    aborted = core.abort_requests([], groups=["g"])
    assert sorted(aborted) == ["g-0", "g-1", "g-2"]
    assert list(core.scheduler.requests) == ["other"]
    core.abort_requests(["other"])
    assert core.pool.num_used == 0


@contextlib.asynccontextmanager
async def open_llm(**kw: object) -> AsyncIterator[AsyncLLM]:
    args = {"executor": "inline", "show_progress": False, **ENGINE, **kw}
    async with AsyncLLM.open("tiny-random", **args) as llm:
        yield llm


pytestmark = pytest.mark.anyio


async def test_the_first_accepted_sample_wins_and_the_rest_end_at_once() -> None:
    offered: list[RequestOutput] = []

    def accept(out: RequestOutput) -> bool:
        offered.append(out)
        return True

    async with open_llm() as llm:
        won = await llm.race(PROMPT, SPREAD, n=4, accept=accept, request_id="r")
        # asked at once: the losers are gone from the core, blocks and all
        await assert_core_holds_nothing(llm)
        assert won is not None and offered == [won]
        assert won.request_id.startswith("r-") and won.finished
        assert won.outputs[0].finish_reason == "stop"
        # each sample is its own seed's: the winner is what it alone gives
        i = int(won.request_id.rpartition("-")[2])
        alone = await llm.complete(PROMPT, SPREAD.for_choice(i))
        assert alone.outputs[0].token_ids == won.outputs[0].token_ids
        # the samples after the first took the prompt's blocks from it
        assert llm.statistics().prefix_cache_hits >= 3 * 32


async def test_a_race_nobody_wins_returns_none_after_every_sample() -> None:
    offered: list[str] = []

    def refuse(out: RequestOutput) -> bool:
        offered.append(out.request_id)
        return False

    async with open_llm() as llm:
        assert await llm.race(PROMPT, SPREAD, n=3, accept=refuse) is None
        assert len(offered) == 3
        await assert_core_holds_nothing(llm)


async def test_a_cancelled_caller_ends_every_sample() -> None:
    long = SamplingParams(max_tokens=200, ignore_eos=True, seed=3)
    async with open_llm() as llm:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def cancel_when_all_run() -> None:
                    with anyio.fail_after(10):
                        await llm.wait_statistics(lambda s: s.running == 4)
                    scope.cancel()

                tg.start_soon(cancel_when_all_run)
                await llm.race(PROMPT, long, n=4)
                pytest.fail("the race ended before its caller was cancelled")
        assert scope.cancelled_caught
        await assert_core_holds_nothing(llm)
        assert [r.live_requests for r in llm.statistics().replicas] == [0]


async def test_abort_of_the_race_id_ends_it_with_none() -> None:
    long = SamplingParams(max_tokens=200, ignore_eos=True, seed=3)
    async with open_llm() as llm:
        result: list[RequestOutput | None] = []
        async with anyio.create_task_group() as tg:

            async def racer() -> None:
                result.append(await llm.race(PROMPT, long, n=2, request_id="x"))

            tg.start_soon(racer)
            with anyio.fail_after(10):
                await llm.wait_statistics(lambda s: s.running == 2)
            await llm.abort("x")
        assert result == [None]
        await assert_core_holds_nothing(llm)


async def test_an_accept_that_raises_ends_the_race_with_its_error() -> None:
    def broken(out: RequestOutput) -> bool:
        raise KeyError("judge")

    async with open_llm() as llm:
        with pytest.raises(KeyError, match="judge"):
            await llm.race(PROMPT, SPREAD, n=3, accept=broken)
        await assert_core_holds_nothing(llm)
        with pytest.raises(InvalidRequestError, match="positive"):
            await llm.race(PROMPT, SPREAD, n=0)
