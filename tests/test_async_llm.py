"""AsyncLLM: streaming, output kinds, cancellation in every form, admission.

Runs on asyncio and trio. Most tests use the inline executor (same protocol
over a socketpair, no process start-up); test_faults.py covers the process.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import attrs
import numpy as np
import pytest

from structllm import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    OutputKind,
    RequestOutput,
    SamplingParams,
)
from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.model.config import tiny_random_config
from structllm.testing.faults import inject_fault
from tests.core_record import assert_core_holds_nothing, core_state, user_ids

pytestmark = pytest.mark.anyio

ENGINE = {"max_model_len": 256, "num_blocks": 64, "block_size": 16}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 256, size=int(k)).tolist() for k in rng.integers(1, 60, size=n)
    ]


def alone(prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    """Reference tokens: the engine core run synchronously, one request alone."""
    core = EngineCore(EngineConfig(model="tiny-random", **ENGINE))
    core.add_request(
        CoreRequest(request_id="x", prompt_token_ids=tuple(prompt), params=params)
    )
    out: list[int] = []
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            out += o.new_token_ids
    return out


@contextlib.asynccontextmanager
async def open_llm(**kw: object) -> AsyncIterator[AsyncLLM]:
    args = {"executor": "inline", "show_progress": False, **ENGINE, **kw}
    async with AsyncLLM.open("tiny-random", **args) as llm:
        yield llm


async def test_stream_matches_offline_engine() -> None:
    p = prompts(1)[0]
    async with open_llm() as llm:
        async with llm.stream({"prompt_token_ids": p}, GREEDY) as s:
            outs = [out async for out in s]
        assert s.finish_reason == "length"
        assert list(outs[-1].token_ids) == alone(p)
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        await assert_core_holds_nothing(llm)


async def test_64_concurrent_streams_equal_alone() -> None:
    ps = prompts(64, seed=1)
    expected = [alone(p) for p in ps]
    got: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        async with llm.stream({"prompt_token_ids": ps[i]}, GREEDY) as s:
            async for out in s:
                got[i] = list(out.token_ids)

    async with open_llm(max_num_seqs=64, num_blocks=256) as llm:
        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(one, i)
        assert [got[i] for i in range(64)] == expected
        await assert_core_holds_nothing(llm)


async def test_output_kinds_agree() -> None:
    p = "The quick brown fox"
    async with open_llm() as llm:
        texts = {}
        for kind in OutputKind:
            params = SamplingParams(temperature=0, max_tokens=20, output_kind=kind)
            async with llm.stream(p, params) as s:
                outs = [o async for o in s]
            if kind is OutputKind.DELTA:
                texts[kind] = "".join(o.text for o in outs)
                ids = [t for o in outs for t in o.token_ids]
                assert len(ids) == outs[-1].num_generated_tokens
            else:
                texts[kind] = outs[-1].text
            if kind is OutputKind.FINAL:
                assert len(outs) == 1
        assert len(set(texts.values())) == 1


async def test_complete_and_generate() -> None:
    p = prompts(1, seed=3)[0]
    async with open_llm() as llm:
        out = await llm.complete({"prompt_token_ids": p}, GREEDY)
        assert list(out.token_ids) == alone(p)
        async with contextlib.aclosing(
            llm.generate({"prompt_token_ids": p}, GREEDY)
        ) as agen:
            outs = [out async for out in agen]
        last = outs[-1]
        assert last.finished and list(last.token_ids) == alone(p)


async def test_leaving_block_early_aborts_and_frees_blocks() -> None:
    async with open_llm() as llm:
        params = SamplingParams(
            temperature=0, max_tokens=200, output_kind=OutputKind.DELTA
        )
        async with llm.stream("Hello", params) as s:
            n = 0
            async for _ in s:
                n += 1
                if n == 3:
                    break
        await assert_core_holds_nothing(llm)  # 197 tokens short of its end
        assert s.finish_reason == "abort"
        # the id is free again and the engine still serves
        out = await llm.complete("Hello", GREEDY, request_id=s.request_id)
        assert out.finish_reason == "length"


async def wait_prefilling(llm: AsyncLLM, request_id: str, blocks: int) -> None:
    """Until the core holds ``request_id`` with at least ``blocks`` KV blocks
    (its prefill under way), by the core's own reports after each step."""
    with anyio.fail_after(10):
        await llm.wait_statistics(lambda s: s.running == 1 and s.blocks_used >= blocks)
    state = await core_state(llm)
    assert user_ids(state) == {request_id} and state.blocks_used >= blocks


@pytest.mark.parametrize("how", ["deadline", "cancel"])
async def test_deadline_during_prefill(how: str) -> None:
    """A 240-token prompt in 8-token chunks: prefill takes 30 steps (15 blocks).

    The deadline expires (or the scope is cancelled) once the core holds
    4 blocks of it; asked right after, the core holds nothing: it did not
    run another chunk of the abandoned prefill."""
    async with open_llm(max_num_batched_tokens=8) as llm:
        with anyio.move_on_after(3600) as scope:
            s = llm.stream([7] * 240, GREEDY, request_id="long")
            async with anyio.create_task_group() as tg:

                async def expire_mid_prefill() -> None:
                    await wait_prefilling(llm, "long", blocks=4)
                    if how == "deadline":
                        scope.deadline = anyio.current_time()
                    else:
                        scope.cancel()

                tg.start_soon(expire_mid_prefill)
                async with s:
                    async for _ in s:
                        pytest.fail("a token came before the deadline")
        assert scope.cancelled_caught
        assert s.finish_reason == "abort"
        assert s.final_output is not None and s.final_output.token_ids == ()
        await assert_core_holds_nothing(llm)
        assert (await llm.complete("x", GREEDY)).finish_reason == "length"


async def test_cancelled_task() -> None:
    started = anyio.Event()
    held: list[set[str]] = []
    async with open_llm() as llm:

        async def consumer() -> None:
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            try:
                async with llm.stream("Hi", params, request_id="mine") as s:
                    async for _ in s:
                        started.set()
            finally:  # the moment the block is left, cancelled: ask the core
                with anyio.CancelScope(shield=True):
                    held.append(user_ids(await core_state(llm)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            await started.wait()
            tg.cancel_scope.cancel()
        assert held == [set()]
        await assert_core_holds_nothing(llm)


async def test_abort_from_another_task_ends_the_block() -> None:
    async with open_llm() as llm:
        first = anyio.Event()
        async with anyio.create_task_group() as tg:
            s = llm.stream("Hi", SamplingParams(max_tokens=200))

            async def consumer() -> None:
                async with s:
                    async for _ in s:
                        first.set()
                    pytest.fail(
                        "the stream should have been cancelled"
                    )  # pragma: no cover

            tg.start_soon(consumer)
            await first.wait()
            await llm.abort(s.request_id)
            await llm.abort(s.request_id)  # idempotent
        assert s.finish_reason == "abort"
        await assert_core_holds_nothing(llm)


async def test_stop_string_aborts_in_core() -> None:
    """The front end finds the stop string; the core, which would run on to
    200 tokens, drops the request before its next step."""
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with open_llm() as llm:
        base = await llm.complete("Hello", attrs.evolve(long, max_tokens=30))
        stop = base.text[5:7]
        assert stop
        async with llm.stream("Hello", attrs.evolve(long, stop=[stop])) as s:
            async for out in s:
                if out.finished:  # asked at once: after the abort the stop sent
                    assert user_ids(await core_state(llm)) == set()
        await assert_core_holds_nothing(llm)
        assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert out.text == base.text[: base.text.index(stop)]
        assert len(out.token_ids) < 30


async def test_bad_input_names_the_field_and_engine_serves_on() -> None:
    async with open_llm() as llm:
        cases = [
            ("", {}, "prompt"),
            ([300], {}, "prompt"),
            ([1] * 256, {}, "prompt"),
            ("x", {"params": "hot"}, "params"),
        ]
        for prompt, kw, field in cases:
            with pytest.raises(InvalidRequestError) as e:
                async with llm.stream(prompt, kw.get("params", GREEDY)):  # type: ignore[arg-type]
                    pass
            assert e.value.field == field
        async with llm.stream("x", GREEDY, request_id="dup"):
            with pytest.raises(InvalidRequestError, match="already in use") as e:
                async with llm.stream("x", GREEDY, request_id="dup"):
                    pass
            assert e.value.field == "request_id"
        assert (await llm.complete("x", GREEDY)).finish_reason == "length"
        await assert_core_holds_nothing(llm)


async def test_overload() -> None:
    async with open_llm(max_num_seqs=2, max_queued_requests=1) as llm:
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(3):
                await stack.enter_async_context(
                    llm.stream("x", SamplingParams(max_tokens=50))
                )
            with pytest.raises(EngineOverloadedError):
                await stack.enter_async_context(llm.stream("x", GREEDY))
        assert (await llm.complete("x", GREEDY)).finish_reason == "length"


async def test_slow_consumer_gets_merged_deltas_and_stalls_nobody() -> None:
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, output_kind=OutputKind.DELTA
    )
    async with open_llm() as llm:
        reference = await llm.complete("slow", params)
        async with llm.stream("slow", params) as slow:
            # while `slow` is not read at all, another request runs to the end
            other = await llm.complete("fast", GREEDY)
            assert other.finish_reason == "length"
            outs = [o async for o in slow]
        assert "".join(o.text for o in outs) == reference.text
        assert [t for o in outs for t in o.token_ids] == list(reference.token_ids)
        assert len(outs) < 40  # deltas were merged while nobody read


def child_pids() -> set[int]:
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids |= {int(p) for p in (task / "children").read_text().split()}
        except FileNotFoundError:  # the thread ended while we looked
            continue
    return pids


def engine_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("structllm")]


@pytest.mark.parametrize("executor", ["inline", "process"])
async def test_nothing_left_behind(executor: str) -> None:
    children = child_pids()
    async with open_llm(executor=executor) as llm:
        await llm.complete("x", GREEDY)
        if executor == "process":
            assert llm.statistics().core_pid in child_pids()
        else:
            # the core's thread, and its heartbeats through a long step's
            assert sorted(engine_threads()) == [
                "structllm-core-pulse",
                "structllm-inline-core",
            ]
    assert engine_threads() == []
    assert child_pids() == children


def test_inline_cores_one_after_another_in_a_fresh_process() -> None:
    """The first inline core imports Paddle in its own thread (the front end
    never does); the next core's thread must still run Paddle eagerly."""
    code = """
import anyio, sys
from structllm import AsyncLLM, SamplingParams

async def main() -> None:
    for _ in range(2):
        async with AsyncLLM.open(
            "tiny-random", executor="inline", show_progress=False,
            max_model_len=64, num_blocks=16,
        ) as llm:
            out = await llm.complete("hi", SamplingParams(max_tokens=3))
            assert len(out.token_ids) == 3, out

assert "paddle" not in sys.modules
anyio.run(main, backend=sys.argv[1])
"""
    for backend in ("asyncio", "trio"):
        cmd = [sys.executable, "-W", "error", "-c", code, backend]
        subprocess.run(cmd, check=True, timeout=300)


async def test_statistics_report_the_cores_memory() -> None:
    """The KV cache's bytes from its shape; the core's peak RSS from its own
    ``getrusage``, which a process that loaded Paddle and a model exceeds
    the cache by far."""
    c = tiny_random_config()
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    async with open_llm(executor="process") as llm:
        await llm.complete("x", GREEDY)
        await assert_core_holds_nothing(llm)
        stats = llm.statistics()
        assert stats.kv_cache_bytes == 64 * 16 * per_token
        status = await anyio.Path(f"/proc/{stats.core_pid}/status").read_text()
        (hwm,) = [ln for ln in status.splitlines() if ln.startswith("VmHWM:")]
        kib = int(hwm.split()[1])
        # the report is the core's peak as of its last idle heartbeat
        assert 100 * 2**20 < stats.core_peak_rss_bytes <= 1024 * kib


async def test_reusing_an_id_at_once_never_mixes_requests() -> None:
    """A late result for a released request must not land in its successor."""
    async with open_llm() as llm:
        expected = list((await llm.complete("zz", GREEDY)).token_ids)
        for _ in range(20):
            async with llm.stream("x", SamplingParams(max_tokens=200)) as s:
                async for _out in s:
                    break
            out = await llm.complete("zz", GREEDY, request_id=s.request_id)
            assert list(out.token_ids) == expected


async def test_heartbeats_continue_under_submit_and_abort_churn() -> None:
    """Requests aborted before their first step make no step results, so
    only heartbeats say the core lives: through 2 s of such churn it stays
    healthy (heard from within 0.8 s, four intervals) and never restarts."""
    front = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}
    async with open_llm(**front, health_timeout=0.8) as llm:
        before = (await core_state(llm)).steps
        churned = 0
        with anyio.move_on_after(2.0):
            while True:
                async with llm.stream("x", GREEDY):
                    pass  # registered and released without reading
                churned += 1
                assert llm.statistics().healthy, llm.statistics()
                await anyio.sleep(0.01)  # pacing, not synchronisation
        stepped = (await core_state(llm)).steps - before
        # the case named: requests that never reached a step (how many do
        # depends on the machine's load: on a loaded one the core steps
        # more of them before their abort arrives)
        assert churned > 20 and stepped < churned, (churned, stepped)
        assert llm.statistics().restarts == 0
        await assert_core_holds_nothing(llm)


async def test_waiting_for_a_restart_ends_when_the_engine_closes() -> None:
    """A submitter outside open() must not wait forever for a restart."""
    errors: list[BaseException] = []
    failed = anyio.Event()
    async with anyio.create_task_group() as outer:
        with inject_fault("raise_at_step:0"):
            async with open_llm(restart_backoff=30.0) as llm:
                with pytest.raises(EngineDeadError):
                    await llm.complete("x", GREEDY)  # kills the worker

                async def late() -> None:
                    try:
                        await llm.complete("y", GREEDY)  # waits for the restart
                    except EngineDeadError as exc:
                        errors.append(exc)
                        failed.set()

                outer.start_soon(late)
        with anyio.fail_after(5):  # leaving open() must wake it
            await failed.wait()
    assert "shutting down" in str(errors[0])


async def test_cancelled_while_waiting_for_a_restart() -> None:
    """The one await before registration: cancelled there, nothing is left."""
    with inject_fault("raise_at_step:0"):
        async with open_llm(restart_backoff=1.0) as llm:
            with pytest.raises(EngineDeadError):
                await llm.complete("x", GREEDY)  # kills the first worker
            assert not llm.statistics().ready
            with anyio.move_on_after(0.1) as scope:
                await llm.complete("y", GREEDY, request_id="waiting")
            assert scope.cancelled_caught
            assert llm.statistics().live_requests == 0
            with anyio.fail_after(30):  # the restarted engine serves, id free
                out = await llm.complete("y", GREEDY, request_id="waiting")
            assert out.finish_reason == "length"
            await assert_core_holds_nothing(llm)


async def test_a_request_that_cannot_be_encoded_fails_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An encode failure (a value the wire cannot carry) is that request's 400."""
    import structllm.engine.frontend.core_connection as front

    real = front.encode

    def encode(msg: object) -> bytes:
        if isinstance(msg, CoreRequest) and msg.request_id.startswith("poison#"):
            raise OverflowError("can't serialize ints > 2**64 - 1")
        return real(msg)  # type: ignore[arg-type]

    monkeypatch.setattr(front, "encode", encode)
    p = prompts(3)
    async with open_llm() as llm:
        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        results: dict[int, list[int]] = {}

        async def run(i: int) -> None:
            async with llm.stream({"prompt_token_ids": p[i]}, long) as s:
                async for out in s:
                    last = out
            results[i] = list(last.token_ids)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 0)
            tg.start_soon(run, 1)
            await llm.wait_statistics(lambda s: s.running == 2)
            with pytest.raises(InvalidRequestError, match="cannot be sent"):
                async with llm.stream(
                    {"prompt_token_ids": p[2]}, GREEDY, request_id="poison"
                ):
                    pytest.fail("a request that cannot be sent was admitted")
        assert results == {i: alone(p[i], long) for i in (0, 1)}
        assert (await llm.complete({"prompt_token_ids": p[2]}, GREEDY)).token_ids
        await assert_core_holds_nothing(llm)


async def test_an_output_that_fails_to_process_fails_its_request_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from structllm.engine.frontend.output_processor import RequestState
    from structllm.errors import RequestFailedError

    real = RequestState.process

    def process(self: RequestState, step: object) -> object:
        if self.request_id == "poison":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(self, step)  # type: ignore[arg-type]

    monkeypatch.setattr(RequestState, "process", process)
    p = prompts(2)
    async with open_llm() as llm:
        with pytest.raises(RequestFailedError, match="injected"):
            await llm.complete({"prompt_token_ids": p[0]}, GREEDY, request_id="poison")
        out = await llm.complete({"prompt_token_ids": p[1]}, GREEDY)
        assert list(out.token_ids) == alone(p[1])
        await assert_core_holds_nothing(llm)


async def test_cancelled_while_tokenising_off_the_loop_registers_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long text prompt is tokenised in a thread; cancelling the caller
    meanwhile waits for the thread, then raises: nothing is registered and
    the engine serves on."""
    import structllm.engine.frontend.inputs as inputs

    entered, release = threading.Event(), threading.Event()
    real = inputs.parse_prompt

    def slow_parse(prompt: object, tokenizer: object) -> object:
        entered.set()
        release.wait(10)
        return real(prompt, tokenizer)  # type: ignore[arg-type]

    monkeypatch.setattr(inputs, "parse_prompt", slow_parse)
    monkeypatch.setattr(inputs, "OFF_LOOP_CHARS", 10)
    text = "a" * 11
    async with open_llm(max_prompt_bytes=1 << 20) as llm:
        with anyio.CancelScope() as scope:

            async def cancel_once_in_thread() -> None:
                await anyio.to_thread.run_sync(entered.wait)
                scope.cancel()
                release.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_once_in_thread)
                async with llm.stream(text, GREEDY):
                    pytest.fail("the request was admitted after cancellation")
        assert scope.cancelled_caught and llm.statistics().live_requests == 0
        monkeypatch.setattr(inputs, "parse_prompt", real)
        # over the byte cap: refused before tokenising
        with pytest.raises(InvalidRequestError, match="max_prompt_bytes") as info:
            await llm.complete("é" * (1 << 19) + "x", GREEDY)
        assert info.value.field == "prompt"
        out = await llm.complete({"prompt_token_ids": [1, 2, 3]}, GREEDY)
        assert list(out.token_ids) == alone([1, 2, 3])
        await assert_core_holds_nothing(llm)


async def test_complete_with_n_samples_each_prompt_once_and_aborts_them_all() -> None:
    prompt = prompts(1, seed=3)[0]
    sampled = SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
    async with open_llm() as llm:
        out = await llm.complete(prompt, attrs.evolve(sampled, n=3))
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for i, c in enumerate(out.outputs):  # sample i is the request seeded seed + i
            assert list(c.token_ids) == alone(prompt, sampled.for_choice(i))
        assert out.num_generated_tokens == 36 and out.finished
        await assert_core_holds_nothing(llm)

        long = SamplingParams(max_tokens=200, ignore_eos=True, n=2)
        done = anyio.Event()
        result: list[RequestOutput] = []

        async def run() -> None:
            result.append(await llm.complete("Hi", long, request_id="both"))
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(10):
                await llm.wait_statistics(lambda s: s.running == 2)
            await llm.abort("both")  # the id the caller knows ends every sample
            await done.wait()
        assert [c.finish_reason for c in result[0].outputs] == ["abort", "abort"]
        await assert_core_holds_nothing(llm)


async def test_a_stream_refuses_n_samples() -> None:
    async with open_llm() as llm:
        with pytest.raises(InvalidRequestError) as info:
            async with llm.stream("Hi", SamplingParams(n=2)):
                pass  # pragma: no cover
        assert info.value.field == "n"
        with pytest.raises(InvalidRequestError):
            async with contextlib.aclosing(
                llm.generate("Hi", SamplingParams(n=2))
            ) as g:
                async for _ in g:
                    pass  # pragma: no cover
        await assert_core_holds_nothing(llm)


async def test_cancelling_complete_with_n_samples_frees_every_sample() -> None:
    long = SamplingParams(max_tokens=200, ignore_eos=True, n=3)
    async with open_llm() as llm:
        async with anyio.create_task_group() as tg:
            tg.start_soon(llm.complete, "Hi", long)
            with anyio.fail_after(10):
                await llm.wait_statistics(lambda s: s.running == 3)
            tg.cancel_scope.cancel()  # the caller's scope, not an abort
        await assert_core_holds_nothing(llm)
        out = await llm.complete("Hi", SamplingParams(max_tokens=2, n=2))
        assert [len(c.token_ids) for c in out.outputs] == [2, 2]  # serving on
        await assert_core_holds_nothing(llm)
