"""The engine core's own record of its requests and KV blocks, for tests.

:meth:`AsyncLLM.inspect_cores` asks each core directly. The question travels
behind every message the front end sent before it (aborts included) and the
core answers it between steps, before it runs the next one. So a request the
front end released before asking is gone from the answer, with its blocks
free, or the core would have run at least one more step holding it: the
promise of docs/cancellation.md ("freed before the core's next step") checked
where it is kept, in steps, not by waiting some seconds for a count to drop.
"""

from __future__ import annotations

import anyio

from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.protocol import CoreState

__all__ = ["assert_core_holds_nothing", "core_state", "user_ids"]


async def core_state(llm: AsyncLLM) -> CoreState:
    """The one core's record (``data_parallel_size`` 1)."""
    with anyio.fail_after(10):  # a safety net only: the answer is one message
        (state,) = await llm.inspect_cores()
    assert state is not None
    return state


def user_ids(state: CoreState) -> set[str]:
    """The caller's ids of the core's requests (core ids are ``{id}#{n}``)."""
    return {rid.rpartition("#")[0] for rid in state.request_ids}


async def assert_core_holds_nothing(llm: AsyncLLM) -> None:
    """Nothing live in the front end, and, asked now, nothing in any core:
    no request, no KV block (a draft model's included), no grammar compiling."""
    assert llm.statistics().live_requests == 0
    with anyio.fail_after(10):
        states = await llm.inspect_cores()
    for state in states:
        assert state is not None
        assert state.request_ids == [], state
        assert state.blocks_used == 0, state
        assert state.draft_blocks_used == 0, state
        assert state.grammars_compiling == 0, state
