"""Races and pins: scopes whose structure the engine core knows.

A request already carries its caller's deadline to the core
(:meth:`~structllm.engine.frontend.async_llm.AsyncLLM.submit`). Two more
shapes of a scope reach it here:

- **A race** (:func:`run_race`, ``AsyncLLM.race``): ``n`` samples of one
  prompt submitted as one group (``CoreRequest.group``); they share the
  prompt's blocks through the prefix cache (the samples after the first wait
  for its blocks rather than compute them again). Each sample's final output
  is offered to ``accept`` as it finishes; the first taken ends the race
  (an ``accept`` that raises ends it with that error, as itself):
  the others leave the front end at once and one ``AbortRequests`` naming
  the group ends them in the core before its next step. Leaving by any other
  path (cancellation, an error, every sample refused) does the same.
- **A pin** (:func:`open_pin`, ``AsyncLLM.pin``): the prefix is submitted as
  a request that samples one token (``max_tokens=1``, greedy) with
  ``CoreRequest.pin`` set; when it finishes, the core's block pool holds its
  prompt's full cached blocks under the request's id (a reference, so they
  are never evicted). A request rather than a message of its own: the
  prefill is then scheduled, chunked, budgeted, preempted and aborted as
  any prompt's, and the one sampled token costs one position of the last
  chunk. Leaving the block sends the abort of that id synchronously, as a
  released request's (the core frees the pin before its next step); with
  data parallelism the pin lives on the replica that prefilled it and the
  router sends prompts that start with it there
  (:meth:`~structllm.engine.frontend.routing.PrefixRouter.pin`).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import attrs

from structllm.engine.frontend.inputs import PromptInput
from structllm.engine.frontend.output_processor import RequestState
from structllm.errors import InvalidRequestError, RequestFailedError, unwrap_group
from structllm.outputs import RequestOutput
from structllm.params import OutputKind, SamplingParams

if TYPE_CHECKING:
    from structllm.engine.frontend.front_end import FrontEnd

__all__ = ["PinnedPrefix", "core_deadline", "open_pin", "run_race"]


@attrs.frozen
class PinnedPrefix:
    """What ``async with llm.pin(prefix) as pinned`` holds."""

    #: the caller's id of the pin (the core's is ``core_id``)
    request_id: str
    core_id: str
    prompt_token_ids: tuple[int, ...]
    #: leading prompt tokens kept cached: the full blocks' worth
    num_pinned_tokens: int


async def run_race(
    llm: FrontEnd,
    prompt: PromptInput,
    params: SamplingParams,
    n: int,
    accept: Callable[[RequestOutput], bool] | None,
    request_id: str,
    priority: int,
) -> RequestOutput | None:
    """``AsyncLLM.race``: see the module docstring."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidRequestError(f"n must be a positive integer, not {n!r}", field="n")
    if params.n != 1:
        raise InvalidRequestError(
            "n: a race's size is race(n=...), not SamplingParams.n", field="n"
        )
    params = attrs.evolve(params, output_kind=OutputKind.FINAL)
    group = f"race-{uuid.uuid4().hex}"  # the core's name: unique, as core ids
    states: list[RequestState] = []
    won: list[RequestOutput] = []
    # while they run, abort(request_id) finds the samples under it
    with llm.samples_under(request_id, [f"{request_id}-{i}" for i in range(n)]):
        try:
            for i in range(n):
                states.append(
                    await llm.submit(
                        prompt,
                        params.for_choice(i),
                        f"{request_id}-{i}",
                        priority,
                        group=group,
                    )
                )
            async with anyio.create_task_group() as tg:

                async def run(state: RequestState) -> None:
                    last = None
                    while (out := await state.mailbox.next()) is not None:
                        last = out
                    if (
                        not won
                        and last is not None
                        and state.finish_reason in ("stop", "length")
                        and (accept is None or accept(last))
                    ):
                        won.append(last)
                        llm.end_group(group, states)
                        tg.cancel_scope.cancel()

                for state in states:
                    tg.start_soon(run, state)
        except BaseExceptionGroup as errors:  # accept raised, or the engine died
            raise unwrap_group(errors) from None
        finally:
            llm.end_group(group, states)
    return won[0] if won else None


@asynccontextmanager
async def open_pin(
    llm: FrontEnd, prompt: PromptInput, request_id: str
) -> AsyncIterator[PinnedPrefix]:
    """``AsyncLLM.pin``: see the module docstring."""
    params = SamplingParams(
        max_tokens=1, temperature=0, ignore_eos=True, output_kind=OutputKind.FINAL
    )
    state = await llm.submit(prompt, params, request_id, pin=True)
    try:
        try:
            while await state.mailbox.next() is not None:
                pass
        finally:
            llm.drop(state)
        if state.finish_reason not in ("stop", "length"):
            # the core dropped its prefill (a deadline passed): a cancelled
            # caller hears of its cancellation rather than this
            await anyio.lowlevel.checkpoint_if_cancelled()
            raise RequestFailedError(
                f"pin: the prefix's prefill ended ({state.finish_reason}); "
                "nothing is pinned"
            )
        bs = llm.block_size  # known: it just ran a request
        ids = tuple(state.prompt_token_ids)
        yield PinnedPrefix(request_id, state.core_id, ids, len(ids) // bs * bs)
    finally:
        llm.unpin_nowait(state.core_id)


def core_deadline() -> float | None:
    """The caller's effective deadline on the core's clock, or None.

    The scope's deadline is on the event loop's clock (a trio ``MockClock``'s
    virtual time, even); the core, a thread or a child process on this
    machine, reads ``time.monotonic()``: what is left of the scope now is
    carried over. A scope already cancelled gives a deadline passed.
    """
    deadline = anyio.current_effective_deadline()
    if deadline == math.inf:
        return None
    return time.monotonic() + max(0.0, deadline - anyio.current_time())
