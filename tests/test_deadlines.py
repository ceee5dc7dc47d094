"""Deadlines reach the core: earliest deadline first within a priority (the
others never starve), and a request past its deadline is never run again,
dropped by the core itself whatever its state.

The scheduler tests move a fake clock by hand; the front-end tests give the
caller's scope a deadline and ask the core what it holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest

from structllm import RequestOutput, SamplingParams
from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest, RequestStatus
from structllm.engine.frontend.async_llm import AsyncLLM
from tests.core_record import assert_core_holds_nothing
from tests.scope_fixtures import HandScheduler

# -- order --------------------------------------------------------------------


def test_waiting_requests_run_earliest_deadline_first_within_a_priority() -> None:
    h = HandScheduler(max_num_seqs=1)
    h.add("none", 4)
    h.add("late", 4, deadline=20.0)
    h.add("urgent", 4, deadline=5.0, priority=1)  # priority still comes first
    h.add("soon", 4, deadline=10.0)
    h.run_until_idle()
    assert h.started == ["soon", "late", "none", "urgent"]


def test_fcfs_order_ignores_deadlines() -> None:
    h = HandScheduler(max_num_seqs=1, scheduling_order="fcfs")
    h.add("none", 4)
    h.add("late", 4, deadline=20.0)
    h.add("soon", 4, deadline=10.0)
    h.run_until_idle()
    assert h.started == ["none", "late", "soon"]


def test_a_request_without_deadline_is_not_starved_by_deadlines() -> None:
    """It ranks as due ``deadline_starvation_s`` after its arrival: a
    deadline due later than that waits behind it, one due earlier not."""
    h = HandScheduler(max_num_seqs=1, deadline_starvation_s=10.0)
    h.add("busy", 4, max_tokens=50)  # holds the one slot meanwhile
    h.step()
    h.add("patient", 4)  # due at 10.0
    h.clock.now = 5.0
    h.add("early", 4, deadline=9.0)
    h.add("later", 4, deadline=11.0)
    h.run_until_idle()
    assert h.started == ["busy", "early", "patient", "later"]


def test_preemption_takes_the_request_due_last() -> None:
    h = HandScheduler(num_blocks=4, block_size=4)
    h.add("relaxed", 4, max_tokens=7, deadline=100.0)
    h.add("urgent", 4, max_tokens=7, deadline=50.0)
    out, _ = h.step()
    assert len(out.chunks) == 2
    preempted: list[str] = []
    while h.scheduler.has_unfinished_requests():
        out, _ = h.step()
        preempted += out.preempted
    assert preempted and set(preempted) == {"relaxed"}


# -- expiry -------------------------------------------------------------------


def test_expired_while_waiting_is_dropped_unrun() -> None:
    h = HandScheduler(max_num_seqs=1)
    h.add("busy", 4, max_tokens=10)
    h.step()
    req = h.add("short", 8, max_tokens=5, deadline=2.0)
    h.step()
    h.clock.now = 2.0
    out, _ = h.step()
    assert out.expired == (req,) and req.finish_reason == "abort"
    assert req.status is RequestStatus.FINISHED and req.block_ids == []
    assert h.ran["short"] == 0
    stats = h.scheduler.statistics()
    # the whole prompt, then a decode per token after the first
    assert (stats.num_expired, stats.expired_tokens_skipped) == (1, 8 + 4)
    h.run_until_idle()
    assert h.pool.num_used == 0


def test_expired_mid_prefill_runs_no_further_chunk() -> None:
    h = HandScheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    req = h.add("long", 40, max_tokens=2, deadline=3.0)
    for _ in range(3):
        h.step()
    assert req.num_computed_tokens == 12 and h.pool.num_used == 3
    h.clock.now = 3.5
    out, _ = h.step()
    assert out.expired == (req,) and out.chunks == ()
    assert h.ran["long"] == 3 and h.pool.num_used == 0
    assert h.scheduler.statistics().expired_tokens_skipped == 28 + 1


def test_expired_while_preempted_is_never_recomputed() -> None:
    h = HandScheduler(num_blocks=4, block_size=4)
    h.add("urgent", 4, max_tokens=7, deadline=50.0)
    victim = h.add("relaxed", 4, max_tokens=7, deadline=10.0 + 90.0)
    while victim.status is not RequestStatus.PREEMPTED:
        h.step()
    steps = h.ran["relaxed"]
    h.clock.now = 100.0
    out, _ = h.step()
    assert victim in out.expired and h.ran["relaxed"] == steps
    assert victim not in h.scheduler.waiting


def test_a_deadline_already_past_at_admission_never_runs() -> None:
    h = HandScheduler()
    h.clock.now = 5.0
    h.add("late", 4, deadline=1.0)
    out, _ = h.step()
    assert [r.request_id for r in out.expired] == ["late"] and not out.chunks
    assert not h.scheduler.has_unfinished_requests()


def test_the_core_reports_an_expired_request_as_aborted() -> None:
    core = EngineCore(
        EngineConfig(model="tiny-random", max_model_len=64, num_blocks=16)
    )
    core.add_request(
        CoreRequest(
            request_id="gone",
            prompt_token_ids=(1, 2, 3),
            params=SamplingParams(max_tokens=4),
            deadline=0.0,  # long past on the monotonic clock
        )
    )
    out = core.step()
    assert [(o.request_id, o.finish_reason) for o in out.outputs] == [("gone", "abort")]
    assert out.num_expired == 1 and out.expired_tokens_skipped == 3 + 3
    assert not core.has_unfinished_requests() and core.pool.num_used == 0


# -- through the front end ----------------------------------------------------

ENGINE = {"max_model_len": 1024, "num_blocks": 128, "block_size": 16}
LONG = SamplingParams(max_tokens=200, ignore_eos=True)
#: 1000 decode steps: seconds, far beyond the deadlines below
HOG = SamplingParams(max_tokens=1000, ignore_eos=True)


@contextlib.asynccontextmanager
async def open_llm(**kw: object) -> AsyncIterator[AsyncLLM]:
    args = {"executor": "inline", "show_progress": False, **ENGINE, **kw}
    async with AsyncLLM.open("tiny-random", **args) as llm:
        yield llm


@contextlib.asynccontextmanager
async def one_slot_taken(llm: AsyncLLM) -> AsyncIterator[None]:
    """A request decoding in the engine's one sequence slot meanwhile."""
    async with anyio.create_task_group() as tg:
        busy = anyio.Event()

        async def hog() -> None:
            async with llm.stream("x", HOG, request_id="hog") as s:
                async for _ in s:
                    busy.set()

        tg.start_soon(hog)
        await busy.wait()
        yield
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_the_core_drops_a_waiting_request_at_its_deadline_unasked() -> None:
    """Submitted inside a 0.2 s scope, then held past it with no abort sent:
    the core ends it by itself ("abort"), having never run it."""
    async with open_llm(max_num_seqs=1) as llm:
        async with one_slot_taken(llm):
            with anyio.move_on_after(0.2):
                state = await llm.submit("y", LONG, "waiter")
            try:  # the scope is over; the front end sends nothing
                with anyio.fail_after(10):
                    outs = [o async for o in _drain(state)]
            finally:
                llm.release(state)
            assert state.finish_reason == "abort" and outs[-1].token_ids == ()
            stats = llm.statistics()
            assert stats.deadline_expired_requests == 1
            prompt = len(state.prompt_token_ids)
            assert stats.deadline_skipped_tokens == prompt + 199
        await assert_core_holds_nothing(llm)


@pytest.mark.anyio
async def test_a_deadline_that_passes_mid_prefill_frees_the_blocks() -> None:
    """A 1000-token prompt a token a step: the core stops it when the
    deadline passes, whatever the scope does after.

    How many steps fit in a deadline depends on the machine (1000 one-token
    steps take 0.3-0.9 s on these): a deadline that expires before the
    first chunk or after the last is retried shorter or longer until one
    lands mid-prefill; each try must end aborted, counted and freed."""
    prompt = 1000
    # the tokens skipped past the prompt: max_model_len leaves room for 24
    # outputs, the first of them sampled by the prompt's last chunk
    outputs = ENGINE["max_model_len"] - prompt - 1
    async with open_llm(max_num_batched_tokens=1) as llm:
        seconds, skipped = 0.3, 0
        for expired in range(1, 9):
            before = llm.statistics().deadline_skipped_tokens
            with anyio.move_on_after(seconds):
                state = await llm.submit([7] * prompt, LONG, "long")
            try:
                with anyio.fail_after(10):
                    async for _ in _drain(state):
                        pass
            finally:
                llm.release(state)
            assert state.finish_reason == "abort"
            stats = llm.statistics()
            assert stats.deadline_expired_requests == expired
            await assert_core_holds_nothing(llm)
            skipped = stats.deadline_skipped_tokens - before
            if skipped <= outputs:  # the whole prompt ran: a shorter deadline
                seconds /= 3
            elif skipped == prompt + outputs:  # nothing ran: a longer one
                seconds *= 2
            else:
                break
        # some chunks ran, not all: the rest were skipped
        assert outputs < skipped < prompt + outputs, seconds


@pytest.mark.anyio
async def test_earliest_deadline_runs_first_through_the_front_end() -> None:
    async with open_llm(max_num_seqs=1) as llm:
        order: list[str] = []
        short = SamplingParams(max_tokens=2, ignore_eos=True)
        async with one_slot_taken(llm), anyio.create_task_group() as tg:

            async def one(name: str, seconds: float) -> None:
                with anyio.move_on_after(seconds):
                    async with llm.stream("z", short, request_id=name) as s:
                        async for _ in s:
                            if name not in order:
                                order.append(name)

            tg.start_soon(one, "relaxed", 60)
            tg.start_soon(one, "urgent", 30)
            with anyio.fail_after(10):
                await llm.wait_statistics(lambda s: s.waiting == 2)
            await llm.abort("hog")
        assert order == ["urgent", "relaxed"]
        await assert_core_holds_nothing(llm)


async def _drain(state: object) -> AsyncIterator[RequestOutput]:
    from structllm.engine.frontend.output_processor import RequestState

    assert isinstance(state, RequestState)
    while (out := await state.mailbox.next()) is not None:
        yield out


# -- over HTTP ------------------------------------------------------------------

#: 2,000 tokens: over a second on the tiny model (see test_server_app)
HTTP_ENGINE = {"max_model_len": 2048, "num_blocks": 136}
HTTP_LONG = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True}


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["body", "header"])
async def test_a_request_timeout_from_the_body_or_header_is_408(how: str) -> None:
    from tests.test_server_app import assert_error, events, open_server

    body: dict[str, object] = dict(HTTP_LONG)
    headers = {}
    if how == "body":
        body["timeout"] = 0.2
    else:
        headers["X-Request-Timeout"] = "0.2"
    async with open_server(engine=HTTP_ENGINE) as s:
        r = await s.http.post("/v1/completions", json=body, headers=headers)
        assert "longer than 0.2s" in assert_error(r, 408)
        await s.wait_idle()
        r = await s.http.post(
            "/v1/completions", json={**body, "stream": True}, headers=headers
        )
        got = events(r.text)
        assert got[-1] == "[DONE]" and got[-2]["error"]["code"] == 408
        chat = {
            "messages": [{"role": "user", "content": "hi"}],
            **{k: v for k, v in body.items() if k != "prompt"},
        }
        r = await s.http.post("/v1/chat/completions", json=chat, headers=headers)
        assert "longer than 0.2s" in assert_error(r, 408)
        await s.wait_idle()
        batch = {**chat, "messages": [chat["messages"], chat["messages"]]}
        r = await s.http.post("/v1/chat/completions/batch", json=batch, headers=headers)
        assert "longer than 0.2s" in assert_error(r, 408)
        await s.wait_idle()
        if how == "header":  # the Messages API has no timeout field
            msg = {
                "model": "tiny-random",
                "max_tokens": 2000,
                "messages": [{"role": "user", "content": "hi"}],
            }
            r = await s.http.post("/v1/messages", json=msg, headers=headers)
            assert r.status_code == 408, r.text
            r = await s.http.post(
                "/v1/messages", json={**msg, "stream": True}, headers=headers
            )
            assert "timeout_error" in r.text.rsplit("event:", 1)[-1]
            await s.wait_idle()
            # the Responses API, whole and streamed
            resp = {"input": "hi", "max_output_tokens": 2000}
            r = await s.http.post("/v1/responses", json=resp, headers=headers)
            assert "longer than 0.2s" in assert_error(r, 408)
            await s.wait_idle()
            r = await s.http.post(
                "/v1/responses", json={**resp, "stream": True}, headers=headers
            )
            last = events(r.text, named=True)[-1]  # event: error
            assert last["type"] == "error" and "longer than 0.2s" in last["message"]
            await s.wait_idle()
            # llama.cpp's and Ollama's streams
            native = {"prompt": "hi", "n_predict": 2000, "stream": True}
            r = await s.http.post("/completion", json=native, headers=headers)
            assert "longer than 0.2s" in r.text.rstrip().rsplit("\n", 1)[-1]
            await s.wait_idle()
            generate = {**msg, "prompt": "hi", "options": {"num_predict": 2000}}
            del generate["messages"], generate["max_tokens"]
            r = await s.http.post("/api/generate", json=generate, headers=headers)
            assert "longer than 0.2s" in r.text.rstrip().rsplit("\n", 1)[-1]
            await s.wait_idle()
        metrics = (await s.http.get("/metrics")).text
        assert "structllm_deadline_expired_requests_total" in metrics
        assert "structllm_deadline_skipped_tokens_total" in metrics


@pytest.mark.anyio
async def test_the_server_request_timeout_caps_a_longer_one() -> None:
    from tests.test_server_app import assert_error, open_server

    async with open_server(request_timeout=0.2, engine=HTTP_ENGINE) as s:
        body = {**HTTP_LONG, "timeout": 3600}
        r = await s.http.post(
            "/v1/completions", json=body, headers={"X-Request-Timeout": "60"}
        )
        assert "longer than 0.2s" in assert_error(r, 408)
        await s.wait_idle()


@pytest.mark.anyio
async def test_bad_timeouts_are_400() -> None:
    from tests.test_server_app import assert_error, open_server

    async with open_server() as s:
        for value in ["soon", "0", "-1", "nan", "inf"]:
            r = await s.http.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 2},
                headers={"X-Request-Timeout": value},
            )
            assert "X-Request-Timeout" in assert_error(r, 400, "X-Request-Timeout")
        for value in [0, -1, "x", 10**6]:
            r = await s.http.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 2, "timeout": value},
            )
            assert_error(r, 400, "timeout")


@pytest.mark.anyio
async def test_priority_over_http_orders_the_waiting_requests() -> None:
    from tests.test_server_app import open_server

    async with open_server(engine={"max_num_seqs": 1}) as s:
        done: list[int] = []
        async with one_slot_taken(s.llm), anyio.create_task_group() as tg:

            async def post(priority: int) -> None:
                body = {"prompt": "y", "max_tokens": 2, "priority": priority}
                r = await s.http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                done.append(priority)

            tg.start_soon(post, 5)
            with anyio.fail_after(10):
                await s.llm.wait_statistics(lambda st: st.waiting == 1)
            tg.start_soon(post, -5)
            with anyio.fail_after(10):
                await s.llm.wait_statistics(lambda st: st.waiting == 2)
            await s.llm.abort("hog")
        assert done == [-5, 5]
        await s.wait_idle()
