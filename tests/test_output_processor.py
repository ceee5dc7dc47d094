"""The output processor: stop strings, abort decisions, finishing, mailboxes."""

from __future__ import annotations

import anyio
import pytest

from structllm.core.engine_core import RequestStepOutput
from structllm.engine.frontend.output_processor import (
    OutputProcessor,
    RequestOutputCollector,
    RequestState,
)
from structllm.errors import EngineDeadError, RequestFailedError
from structllm.outputs import RequestOutput
from structllm.params import OutputKind, SamplingParams
from structllm.text.tokenizer import Tokenizer, load_tokenizer

TOKENIZER: Tokenizer = load_tokenizer("tiny-random")  # byte ids


def ids(text: str) -> tuple[int, ...]:
    return tuple(TOKENIZER.encode(text, add_special_tokens=False))


def state(
    request_id: str = "r",
    *,
    core_id: str | None = None,
    queue: RequestOutputCollector | None = None,
    **params: object,
) -> RequestState:
    return RequestState(
        request_id,
        "p",
        ids("p"),
        SamplingParams(**params),  # type: ignore[arg-type]
        TOKENIZER,
        core_id=core_id or request_id,
        queue=queue,
    )


def step(rid: str, text: str, **kw: object) -> RequestStepOutput:
    return RequestStepOutput(rid, ids(text), **kw)  # type: ignore[arg-type]


def test_a_stop_string_split_over_steps_ends_the_request_and_asks_for_abort() -> None:
    proc = OutputProcessor()
    s = state(stop=["END"], output_kind=OutputKind.DELTA)
    proc.add(s)
    deltas: list[str] = []
    for chunk in ["ab E", "N", "D and more"]:
        result = proc.process_outputs([step("r", chunk)])
        deltas += [out.text for _, out in result.outputs]
        if s.finished:
            break
    assert s.finished and s.finish_reason == "stop" and s.stop_reason == "END"
    assert result.to_abort == ["r"]  # the core does not know about stop strings
    assert result.finished == [s] and len(proc) == 0
    assert "".join(deltas) == "ab "  # no part of the stop string leaked
    assert result.outputs[-1][1].finished


def test_the_stop_string_can_be_kept() -> None:
    proc = OutputProcessor()
    s = state(stop=["END"], include_stop_str_in_output=True)
    proc.add(s)
    proc.process_outputs([step("r", "xEN")])
    result = proc.process_outputs([step("r", "Dy")])
    ((_, out),) = result.outputs
    assert out.text == "xEND" and out.finish_reason == "stop"


def test_a_finish_the_core_reports_needs_no_abort() -> None:
    proc = OutputProcessor()
    s = state(output_kind=OutputKind.FINAL)
    proc.add(s)
    assert proc.process_outputs([step("r", "ab")]).outputs == []  # FINAL: not yet
    result = proc.process_outputs(
        [step("r", "c", finish_reason="length", queue_s=0.5, num_cached_tokens=16)]
    )
    assert result.to_abort == [] and result.finished == [s]
    ((_, out),) = result.outputs
    assert out.text == "abc" and out.finish_reason == "length"
    assert out.queue_time == 0.5 and out.num_cached_tokens == 16


def test_outputs_for_unknown_ids_are_aborted() -> None:
    proc = OutputProcessor()
    proc.add(state("a"))
    result = proc.process_outputs([step("gone", "x"), step("a", "y")])
    assert result.to_abort == ["gone"]
    assert [s.request_id for s, _ in result.outputs] == ["a"]


def test_first_tokens_are_taken_before_the_running_requests_next_ones() -> None:
    proc = OutputProcessor()
    old, new, newer = state("old"), state("new"), state("newer")
    for s in (old, new, newer):
        proc.add(s)
    proc.process_outputs([step("old", "a")])
    # the core lists the newest requests last
    result = proc.process_outputs(
        [step("old", "b"), step("new", "c"), step("newer", "d")]
    )
    assert [s.request_id for s, _ in result.outputs] == ["new", "newer", "old"]
    result = proc.process_outputs(
        [step("old", "e"), step("new", "f"), step("newer", "g")]
    )
    assert [s.request_id for s, _ in result.outputs] == ["old", "new", "newer"]


# trio runs a batch of woken tasks in a random direction, so only asyncio's
# order (the order of the wake-ups) can be asserted
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_a_first_token_wakes_its_consumer_before_the_others() -> None:
    proc = OutputProcessor()
    woken: list[str] = []
    queues = {rid: RequestOutputCollector(OutputKind.DELTA) for rid in ("old", "new")}
    for rid, q in queues.items():
        proc.add(state(rid, queue=q, output_kind=OutputKind.DELTA))
    proc.process_outputs([step("old", "a")])
    assert await queues["old"].next() is not None

    async def consume(rid: str) -> None:
        await queues[rid].next()
        woken.append(rid)

    async with anyio.create_task_group() as tg:
        for rid in queues:
            tg.start_soon(consume, rid)
        await anyio.wait_all_tasks_blocked()
        proc.process_outputs([step("old", "b"), step("new", "c")])
    assert woken == ["new", "old"]


def test_a_request_that_fails_to_process_fails_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = RequestState.process

    def process(self: RequestState, out: RequestStepOutput) -> RequestOutput | None:
        if self.request_id == "bad":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(self, out)

    monkeypatch.setattr(RequestState, "process", process)
    proc = OutputProcessor()
    bad, good = state("bad"), state("good")
    proc.add(bad)
    proc.add(good)
    result = proc.process_outputs([step("bad", "x"), step("good", "y")])
    assert result.to_abort == ["bad"]
    ((failed, error),) = result.failed
    assert failed is bad and bad.finish_reason == "error"
    assert isinstance(error, RequestFailedError)
    assert isinstance(error.__cause__, UnicodeDecodeError)
    assert [s for s, _ in result.outputs] == [good] and len(proc) == 1


def test_core_ids_and_caller_ids_are_both_indexed() -> None:
    idle: list[bool] = []
    proc = OutputProcessor(on_idle=lambda: idle.append(True))
    s = state("mine", core_id="mine#7")
    proc.add(s)
    with pytest.raises(ValueError, match="already live"):
        proc.add(state("mine", core_id="mine#8"))
    assert proc.get("mine") is s and proc.get("mine#7") is None
    result = proc.process_outputs([step("mine#7", "x", finish_reason="stop")])
    assert result.finished == [s] and proc.get("mine") is None and idle == [True]


@pytest.mark.anyio
async def test_release_finishes_a_live_request_as_abort_once() -> None:
    proc = OutputProcessor()
    queue = RequestOutputCollector(OutputKind.CUMULATIVE)
    s = state(queue=queue)
    proc.add(s)
    proc.process_outputs([step("r", "ab")])
    assert proc.release(s) is True  # the caller must abort it in the core
    assert proc.release(s) is False  # idempotent
    first = await queue.next()
    assert first is not None and first.finish_reason == "abort"
    assert first.text == "ab"
    assert await queue.next() is None


@pytest.mark.anyio
async def test_fail_all_raises_to_every_consumer() -> None:
    proc = OutputProcessor()
    queues = [RequestOutputCollector(OutputKind.DELTA) for _ in range(3)]
    for i, q in enumerate(queues):
        proc.add(state(str(i), queue=q))
    proc.fail_all(lambda: EngineDeadError("gone"))
    assert len(proc) == 0
    for q in queues:
        with pytest.raises(EngineDeadError):
            await q.next()


@pytest.mark.anyio
async def test_a_lagging_consumer_gets_merged_deltas() -> None:
    proc = OutputProcessor()
    queue = RequestOutputCollector(OutputKind.DELTA)
    proc.add(state(queue=queue, output_kind=OutputKind.DELTA))
    for chunk in ["a", "b", "c"]:
        proc.process_outputs([step("r", chunk)])
    out = await queue.next()
    assert out is not None and out.text == "abc" and out.token_ids == ids("abc")
    proc.process_outputs([step("r", "d", finish_reason="length")])
    out = await queue.next()
    assert out is not None and out.text == "d" and out.finished
    assert await queue.next() is None


@pytest.mark.anyio
async def test_a_cumulative_output_supersedes_the_pending_one() -> None:
    queue = RequestOutputCollector(OutputKind.CUMULATIVE)
    proc = OutputProcessor()
    proc.add(state(queue=queue))
    proc.process_outputs([step("r", "a")])
    proc.process_outputs([step("r", "b")])
    out = await queue.next()
    assert out is not None and out.text == "ab"


@pytest.mark.anyio
async def test_next_is_a_checkpoint_even_with_an_output_ready() -> None:
    queue = RequestOutputCollector(OutputKind.CUMULATIVE)
    proc = OutputProcessor()
    proc.add(state(queue=queue))
    proc.process_outputs([step("r", "a")])
    with anyio.CancelScope() as scope:
        scope.cancel()
        await queue.next()
        pytest.fail("next() did not raise under cancellation")  # pragma: no cover
    assert scope.cancelled_caught
