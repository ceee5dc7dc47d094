"""Pinned prefixes: held blocks the eviction policy respects, released on
every exit of the pin's block before the core's next step, capped."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest

from structllm import InvalidRequestError, SamplingParams
from structllm.core.block_pool import BlockPool, hash_block_tokens, root_hash
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.frontend.routing import PrefixRouter
from tests.core_record import assert_core_holds_nothing, core_state
from tests.scope_fixtures import HandScheduler

# -- the pool and the scheduler ----------------------------------------------


def _hashes(tokens: list[int], block_size: int) -> list[bytes]:
    parent, out = root_hash(None), []
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(
            parent, tokens[i * block_size : (i + 1) * block_size]
        )
        out.append(parent)
    return out


def test_a_pinned_block_is_never_evicted_and_keeps_its_hash() -> None:
    pool = BlockPool(4, 2)
    blocks = pool.allocate(2)
    hashes = _hashes([1, 2, 3, 4], 2)
    for b, h in zip(blocks, hashes, strict=True):
        pool.cache_block(b, h)
    pool.free(blocks)
    assert pool.pin("p", hashes) == blocks
    assert pool.num_free == 2
    pool.allocate(2)  # the other two: nothing pinned is taken
    assert pool.num_free == 0
    assert pool.reset_prefix_cache() == 0  # the pinned hashes stay
    assert pool.lookup(hashes) == blocks
    pool.audit()
    assert pool.unpin("p") and not pool.unpin("p")
    assert pool.num_cached == 2  # cached, free, evictable again
    pool.audit()


def test_a_finished_pin_request_holds_its_prompt_blocks_until_aborted() -> None:
    h = HandScheduler(num_blocks=8, block_size=4)
    prefix = tuple(range(1, 11))  # 2 full blocks and 2 tokens
    h.add("pin", prefix, max_tokens=1, pin=True)
    h.run_until_idle()
    pinned = h.pool.pinned_blocks()
    assert len(pinned) == 2 and h.pool.num_used == 2
    # other prompts fill the whole pool, repeatedly: the pin survives
    for i in range(4):
        h.add(f"other{i}", 20, max_tokens=4)
        h.run_until_idle()
    assert h.pool.pinned_blocks() == pinned
    req = h.add("user", (*prefix[:8], 99, 98, 97), max_tokens=2)
    h.step()
    assert req.num_cached_tokens == 8
    h.run_until_idle()
    h.scheduler.abort_requests(["pin"])
    assert h.pool.num_used == 0 and not h.pool.pinned_blocks()


def test_a_pin_aborted_mid_prefill_pins_nothing() -> None:
    h = HandScheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    h.add("pin", 20, max_tokens=1, pin=True)
    h.step()
    h.scheduler.abort_requests(["pin"])
    assert h.pool.num_used == 0 and not h.pool.pinned_blocks()


def test_the_router_sends_a_pinned_prefix_to_its_replica_whatever_the_load() -> None:
    router = PrefixRouter(block_size=2, slack=1)
    hashes = router.prefix_hashes([1, 2, 3, 4])
    router.pin("p", hashes, 1)
    longer = router.prefix_hashes([1, 2, 3, 4, 5, 6])
    assert router.order(longer, load=[0, 9], ready=[True, True]) == [1, 0]
    assert router.order(longer, load=[0, 9], ready=[True, False]) == [0]
    router.unpin("p")
    assert router.order(longer, load=[0, 9], ready=[True, True]) == [0, 1]


# -- through the front end ----------------------------------------------------

ENGINE = {"max_model_len": 256, "num_blocks": 24, "block_size": 16}
#: three full blocks and a bit
PREFIX = [(5 * i + 3) % 250 for i in range(50)]


@contextlib.asynccontextmanager
async def open_llm(**kw: object) -> AsyncIterator[AsyncLLM]:
    args = {"executor": "inline", "show_progress": False, **ENGINE, **kw}
    async with AsyncLLM.open("tiny-random", **args) as llm:
        yield llm


async def _fill_the_cache(llm: AsyncLLM, rounds: int) -> None:
    """Distinct prompts that together take every block, again and again."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for r in range(rounds):
        prompts = [
            [(r * 31 + k * 7 + i) % 250 + 1 for i in range(60)] for k in range(4)
        ]
        async with anyio.create_task_group() as tg:
            for p in prompts:
                tg.start_soon(llm.complete, p, params)


pytestmark = pytest.mark.anyio


async def test_a_pinned_prefix_is_hit_under_cache_pressure() -> None:
    async with open_llm() as llm:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        async with llm.pin(PREFIX) as pinned:
            assert pinned.num_pinned_tokens == 48
            state = await core_state(llm)
            assert state.pins == [pinned.core_id] and state.blocks_pinned == 3
            await _fill_the_cache(llm, rounds=3)
            out = await llm.complete([*PREFIX, 9, 9], params)
            assert out.num_cached_tokens == 48
            await llm.reset_prefix_cache()  # forgets all but the pinned
            out = await llm.complete([*PREFIX, 8, 8], params)
            assert out.num_cached_tokens == 48
        await assert_core_holds_nothing(llm)
        assert (await core_state(llm)).pins == []
        # unpinned, the same pressure evicts it
        await _fill_the_cache(llm, rounds=3)
        out = await llm.complete([*PREFIX, 9, 9], params)
        assert out.num_cached_tokens == 0


async def test_a_pin_left_by_cancellation_is_released_before_the_next_step() -> None:
    async with open_llm() as llm:
        with anyio.CancelScope() as scope:
            async with llm.pin(PREFIX):
                assert (await core_state(llm)).blocks_pinned == 3
                scope.cancel()
                await anyio.sleep(3600)
        assert scope.cancelled_caught
        await assert_core_holds_nothing(llm)
        assert (await core_state(llm)).pins == []


async def test_cancelled_while_the_pin_prefills_pins_nothing() -> None:
    async with open_llm(max_num_batched_tokens=1) as llm:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def cancel_mid_prefill() -> None:
                    with anyio.fail_after(10):
                        await llm.wait_statistics(lambda s: s.blocks_used >= 2)
                    scope.cancel()

                tg.start_soon(cancel_mid_prefill)
                async with llm.pin(PREFIX * 4):  # 200 tokens, one a step
                    pytest.fail("pinned before the cancellation")
        assert scope.cancelled_caught
        await assert_core_holds_nothing(llm)
        # nor does the router count it on its replica any more
        assert [r.live_requests for r in llm.statistics().replicas] == [0]


async def test_pins_beyond_the_cap_are_refused_and_others_serve_on() -> None:
    async with open_llm(max_pinned_fraction=0.2) as llm:  # 4 of 24 blocks
        async with llm.pin(PREFIX):
            with pytest.raises(
                InvalidRequestError, match="max_pinned_fraction"
            ) as info:
                async with llm.pin([1, *PREFIX[1:]]):
                    pytest.fail("a second 3-block pin beside the first: 6 > 4")
            assert info.value.field == "pin"
            async with llm.pin(PREFIX[:16]) as second:  # shares a held block
                assert second.num_pinned_tokens == 16
            out = await llm.complete("hi", SamplingParams(max_tokens=2))
            assert out.finish_reason == "length"
        await assert_core_holds_nothing(llm)


async def test_a_prefix_shorter_than_a_block_is_refused() -> None:
    async with open_llm() as llm:
        with pytest.raises(InvalidRequestError, match="fills no"):
            async with llm.pin(PREFIX[:15]):
                pass
        await assert_core_holds_nothing(llm)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # starts two processes
async def test_with_data_parallelism_the_pin_lives_on_one_replica_and_draws_its_prompts() -> (
    None
):
    async with AsyncLLM.open(
        "tiny-random",
        data_parallel_size=2,
        show_progress=False,
        **{**ENGINE, "max_num_seqs": 4},  # an affinity slack of 1
    ) as llm:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        async with llm.pin(PREFIX) as pinned:
            states = await llm.inspect_cores()
            holders = [k for k, st in enumerate(states) if st and st.pins]
            assert len(holders) == 1 and states[holders[0]].pins == [pinned.core_id]
            # far more requests with the prefix than the slack lets one
            # replica take by affinity alone: the pin draws every one
            outs: list[int | None] = []

            async def user(i: int) -> None:
                out = await llm.complete([*PREFIX, i], params)
                outs.append(out.num_cached_tokens)

            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(user, i)
            assert outs == [48] * 12
        for st in await llm.inspect_cores():
            assert st is not None and st.pins == [] and st.blocks_used == 0
