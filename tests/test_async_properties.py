"""AsyncLLM under random mixes of concurrent requests and every way to end one.

One engine per Hypothesis example runs 1-12 requests at once; each request
has a *fate*: it runs to the end, is cancelled before or right after entering
its block, leaves the block after k outputs, hits a deadline, is aborted from
another task, reads slowly, stops reading while holding its block, or goes
through the vLLM-style ``generate()`` (to the end, or closed after k). Then:

- survivors get exactly the tokens of the engine core run alone (for DELTA
  outputs, the concatenated deltas) and ``finish_reason == "length"``;
- every stream ends at most once, with ``"length"`` if its consumer saw the
  end and otherwise ``"abort"`` (or ``"length"`` where the core finished the
  request before the cancellation reached the consumer);
- entering a stream inside an already-cancelled scope either registers the
  request (the block runs, then ends it: ``"abort"``) or raises before
  registering anything (``finish_reason is None``), never half of each;
  with the engine ready, today's ``__aenter__`` does not checkpoint, so it is
  always the former;
- nothing is left behind: no live request, no KV block, no task, no thread;
  and the engine still serves.

Hypothesis drives ``anyio.run`` itself (its ``@given`` does not compose with
the AnyIO plugin's async tests), once per backend.
``STRUCTLLM_ASYNC_EXAMPLES=200`` runs more examples when hunting for bugs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import threading
from collections.abc import AsyncIterator
from typing import Literal

import anyio
import attrs
import numpy as np
import pytest
import sniffio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from structllm import OutputKind, SamplingParams
from structllm.engine.frontend.async_llm import AsyncLLM, RequestStream
from structllm.outputs import RequestOutput
from tests.test_async_llm import alone

MAX_TOKENS = 40

#: prompts from [0, 256), lengths at and around block (16) and chunk sizes
PROMPT_LENGTHS = (1, 2, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 47, 48, 49, 63, 64)
PROMPT_LENGTHS += (65, 72, 79, 80)
_rng = np.random.default_rng(2024)
PROMPTS = tuple(
    tuple(int(t) for t in _rng.integers(0, 256, size=n)) for n in PROMPT_LENGTHS
)

Fate = Literal[
    "complete",
    "cancel_before_enter",
    "cancel_in_prefill",
    "break_after_k",
    "deadline",
    "abort_after_k",
    "slow_checkpoints",
    "slow_late",
    "stop_reading",
    "generate",
    "generate_break_after_k",
]
FATES: tuple[Fate, ...] = Fate.__args__  # type: ignore[attr-defined]
SURVIVORS = frozenset({"complete", "slow_checkpoints", "slow_late", "generate"})
#: fates whose consumers wait for other requests to end
WAITERS = frozenset({"slow_late", "stop_reading"})


@functools.cache
def reference(prompt: int) -> tuple[int, ...]:
    """The greedy tokens of ``PROMPTS[prompt]`` run alone, up to MAX_TOKENS."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return tuple(alone(list(PROMPTS[prompt]), params))


@attrs.frozen(kw_only=True)
class RequestSpec:
    prompt: int  # index into PROMPTS
    max_tokens: int
    output_kind: OutputKind
    fate: Fate
    #: outputs before acting; engine steps before cancelling
    #: (cancel_in_prefill); checkpoints between reads (slow_checkpoints)
    k: int
    #: seconds (deadline)
    delay: float


@attrs.frozen(kw_only=True)
class Scenario:
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    requests: tuple[RequestSpec, ...]


@st.composite
def request_specs(draw: st.DrawFn) -> RequestSpec:
    fate = draw(st.sampled_from(FATES))
    low = 0 if fate in ("cancel_in_prefill", "slow_checkpoints") else 1
    return RequestSpec(
        prompt=draw(st.integers(0, len(PROMPTS) - 1)),
        max_tokens=draw(st.integers(1, MAX_TOKENS)),
        output_kind=draw(st.sampled_from(OutputKind)),
        fate=fate,
        k=draw(st.integers(low, 8)),
        delay=draw(st.sampled_from([0.0, 0.001, 0.005, 0.02, 0.05])),
    )


scenarios = st.builds(
    Scenario,
    # one 256-token sequence needs 16 blocks of 16: small pools preempt
    num_blocks=st.integers(16, 64),
    max_num_seqs=st.integers(1, 12),
    max_num_batched_tokens=st.integers(8, 64),
    requests=st.lists(request_specs(), min_size=1, max_size=12).map(tuple),
)


def prompt_of(spec: RequestSpec) -> dict[str, list[int]]:
    return {"prompt_token_ids": list(PROMPTS[spec.prompt])}


def params_of(spec: RequestSpec) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        max_tokens=spec.max_tokens,
        ignore_eos=True,
        output_kind=spec.output_kind,
    )


@attrs.define(eq=False)
class Record:
    """What one consumer saw."""

    spec: RequestSpec
    stream: RequestStream
    outputs: list[RequestOutput] = attrs.Factory(list)
    entered: bool = False
    #: times the iteration ended with StopAsyncIteration
    ended: int = 0


class Countdown:
    """An event set once ``count_down`` has been called ``n`` times."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.event = anyio.Event()
        if n == 0:
            self.event.set()

    def count_down(self) -> None:
        self.n -= 1
        if self.n == 0:
            self.event.set()


def all_tasks() -> set[object]:
    if sniffio.current_async_library() == "asyncio":
        return set(asyncio.all_tasks())
    import trio

    tasks: set[object] = set()
    todo = [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        tasks.add(task)
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return tasks


def engine_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("structllm")]


async def read(
    rec: Record,
    limit: int | None = None,
    pause: int = 0,
    source: AsyncIterator[RequestOutput] | None = None,
) -> None:
    """Read until the end, or until ``limit`` outputs have been read."""
    if rec.ended or (limit is not None and len(rec.outputs) >= limit):
        return
    async for out in rec.stream if source is None else source:
        rec.outputs.append(out)
        if limit is not None and len(rec.outputs) >= limit:
            return
        for _ in range(pause):
            await anyio.lowlevel.checkpoint()
    rec.ended += 1


async def run_request(
    llm: AsyncLLM,
    rec: Record,
    tg: anyio.abc.TaskGroup,
    independent_done: anyio.Event,
    others_done: anyio.Event,
) -> None:
    spec, s = rec.spec, rec.stream
    if spec.fate.startswith("generate"):
        # the vLLM-style generator: its own request, the stream stays unused
        agen = llm.generate(prompt_of(spec), params_of(spec), request_id=s.request_id)
        async with contextlib.aclosing(agen):
            rec.entered = True
            limit = spec.k if spec.fate == "generate_break_after_k" else None
            await read(rec, limit=limit, source=agen)
    elif spec.fate in SURVIVORS:
        async with s:
            rec.entered = True
            if spec.fate == "slow_late":
                await independent_done.wait()  # everything piles up unread
            await read(rec, pause=spec.k if spec.fate == "slow_checkpoints" else 0)
            with pytest.raises(StopAsyncIteration):  # and stays ended
                await s.__anext__()
    elif spec.fate == "cancel_before_enter":
        with anyio.CancelScope() as scope:
            scope.cancel()
            async with s:
                rec.entered = True
                await read(rec)
        assert scope.cancelled_caught
    elif spec.fate == "cancel_in_prefill":
        with anyio.CancelScope() as scope:
            async with s:
                rec.entered = True
                # wait for k engine steps (one fresh snapshot each): with
                # small chunks, long prompts are then part-way through prefill
                snapshots = itertools.count()
                await llm.wait_statistics(lambda _: next(snapshots) >= spec.k)
                scope.cancel()
                await read(rec)
        assert scope.cancelled_caught
    elif spec.fate == "break_after_k":
        async with s:
            rec.entered = True
            await read(rec, limit=spec.k)
    elif spec.fate == "deadline":
        with anyio.move_on_after(spec.delay):
            async with s:
                rec.entered = True
                await read(rec)
    elif spec.fate == "abort_after_k":
        reached, aborted = anyio.Event(), anyio.Event()

        async def aborter() -> None:
            await reached.wait()
            await llm.abort(s.request_id)
            await llm.abort(s.request_id)  # idempotent
            aborted.set()

        tg.start_soon(aborter)
        try:
            async with s:
                rec.entered = True
                await read(rec, limit=spec.k)
                reached.set()
                await aborted.wait()  # cancelled here unless it finished first
                await read(rec)
        finally:
            reached.set()
    elif spec.fate == "stop_reading":
        async with s:
            rec.entered = True
            await read(rec, limit=spec.k)
            await others_done.wait()
    else:  # pragma: no cover
        raise AssertionError(spec.fate)


def check_outputs(rec: Record, ref: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    """Check the sequence of outputs the consumer saw; return its tokens, text."""
    outs, kind = rec.outputs, rec.spec.output_kind
    tokens: tuple[int, ...] = ()
    text = ""
    for i, out in enumerate(outs):
        assert out.request_id == rec.stream.request_id
        assert out.finished == (out.finish_reason is not None)
        assert not out.finished or i == len(outs) - 1  # nothing after the end
        if kind is OutputKind.DELTA:
            assert out.token_ids or out.finished
            tokens += out.token_ids
            text += out.text
        else:
            assert out.token_ids[: len(tokens)] == tokens  # cumulative grows
            assert out.text.startswith(text)
            tokens, text = out.token_ids, out.text
        assert out.num_generated_tokens == len(tokens)
    if kind is OutputKind.FINAL:
        assert len(outs) <= 1 and all(o.finished for o in outs)
    assert tokens == ref[: len(tokens)]
    return tokens, text


def check_request(rec: Record) -> None:
    spec, s = rec.spec, rec.stream
    ref = reference(spec.prompt)[: spec.max_tokens]
    tokens, text = check_outputs(rec, ref)
    saw_end = bool(rec.outputs) and rec.outputs[-1].finished
    reason = rec.outputs[-1].finish_reason if saw_end else s.finish_reason
    event(f"{spec.fate}: {reason}, {'saw' if saw_end else 'no'} end")
    assert rec.ended <= 1 and (saw_end or not rec.ended)
    if spec.fate.startswith("generate"):
        assert saw_end or (spec.fate != "generate" and len(rec.outputs) == spec.k)
        return
    if not rec.entered:
        # never registered: nothing to abort, nothing to report
        assert spec.fate == "cancel_before_enter"
        assert s.finish_reason is None and s.final_output is None
        return
    final = s.final_output
    assert final is not None and final.finished
    assert final.finish_reason == s.finish_reason
    assert s.finish_reason in ("length", "abort")
    assert final.token_ids == ref[: len(final.token_ids)]
    assert final.token_ids[: len(tokens)] == tokens
    assert final.text.startswith(text)
    if s.finish_reason == "length":
        assert final.token_ids == ref
    if saw_end:
        assert s.finish_reason == "length" and tokens == ref
        assert text == final.text
    if spec.fate in SURVIVORS:
        assert saw_end
    elif spec.fate == "cancel_before_enter":
        assert not rec.outputs and s.finish_reason == "abort"
    elif spec.fate == "cancel_in_prefill":
        assert not rec.outputs
        if spec.k == 0:  # no step can end between entering and cancelling
            assert s.finish_reason == "abort"
    elif spec.fate in ("break_after_k", "abort_after_k") and not saw_end:
        assert s.finish_reason == "abort" and len(rec.outputs) == spec.k


async def scenario(sc: Scenario) -> None:
    tasks_before = all_tasks()
    async with AsyncLLM.open(
        "tiny-random",
        executor="inline",
        show_progress=False,
        max_model_len=256,
        block_size=16,
        num_blocks=sc.num_blocks,
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
    ) as llm:
        tasks_open = all_tasks()
        recs = [
            Record(
                spec,
                llm.stream(prompt_of(spec), params_of(spec), request_id=f"r{i}"),
            )
            for i, spec in enumerate(sc.requests)
        ]
        independent = Countdown(sum(r.spec.fate not in WAITERS for r in recs))
        others = Countdown(sum(r.spec.fate != "stop_reading" for r in recs))

        async def one(rec: Record) -> None:
            try:
                await run_request(llm, rec, tg, independent.event, others.event)
            finally:
                if rec.spec.fate not in WAITERS:
                    independent.count_down()
                if rec.spec.fate != "stop_reading":
                    others.count_down()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for rec in recs:
                    tg.start_soon(one, rec)

        with anyio.fail_after(5):
            await llm.wait_statistics(
                lambda s: s.blocks_used == 0 and s.running == 0 and s.waiting == 0
            )
        assert llm.statistics().live_requests == 0
        assert all_tasks() == tasks_open
        for rec in recs:
            check_request(rec)

        # the engine still serves
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        with anyio.fail_after(10):
            out = await llm.complete({"prompt_token_ids": list(PROMPTS[0])}, params)
        assert out.finish_reason == "length"
        assert out.token_ids == reference(0)[:3]
        assert llm.statistics().live_requests == 0
    assert all_tasks() == tasks_before
    assert engine_threads() == []


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(
    max_examples=int(os.environ.get("STRUCTLLM_ASYNC_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(sc=scenarios)
def test_random_request_fates(backend: str, sc: Scenario) -> None:
    anyio.run(scenario, sc, backend=backend)


@pytest.mark.anyio
async def test_final_output_keeps_text_and_logprobs() -> None:
    # regression: final_output once rebuilt the state with attrs.evolve, whose
    # __attrs_post_init__ made a fresh detokenizer (text "") and no logprobs
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    async with AsyncLLM.open(
        "tiny-random", executor="inline", show_progress=False, max_model_len=256
    ) as llm:
        async with llm.stream("Hello there", params) as s:
            outs = [out async for out in s]
        last, final = outs[-1], s.final_output
        assert final is not None and last.finished
        assert final.token_ids == last.token_ids
        assert final.text == last.text
        assert final.outputs[0].logprobs == last.outputs[0].logprobs
        assert final.outputs[0].cumulative_logprob == last.outputs[0].cumulative_logprob
