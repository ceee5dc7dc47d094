"""Faults injected into the engine cores a test starts, kept out of the settings.

::

    with inject_fault("raise_at_step:5"):
        async with AsyncLLM.open("tiny-random") as llm:
            ...  # the first core raises in its step 5; its restart runs clean

Every engine core started by a client built inside the ``with`` block (an
``AsyncLLM.open`` entered there, each of its data-parallel replicas) gets the
fault for its first ``starts`` starts; later restarts run clean. The core
acts on it (:mod:`structllm.engine.child`):

- ``"raise_at_step:N"``: the forward pass of step N raises;
- ``"hang_at_step:N"``: step N blocks, heartbeats stop;
- ``"exit_at_step:N"``: the process exits at step N;
- ``"slow_at_step:N"``: step N takes 3 s more (heartbeats go on through it,
  up to ``step_timeout``);
- ``"stall_at_step:N"``: step N holds the GIL for 3 s (no thread of the
  process runs: a follower's reader and watchdog wait it out);
- ``"rank1:"`` before one of them: tensor-parallel rank 1 does it instead
  (counting warm-up's forwards).

A context variable carries it (:data:`~structllm.engine.frontend.core_client.core_fault`),
so concurrent tests, threads and tasks started outside the block see none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from structllm.engine.frontend.core_fault import CoreFault, core_fault

__all__ = ["CoreFault", "inject_fault"]


@contextlib.contextmanager
def inject_fault(fault: str, *, starts: int = 1) -> Iterator[CoreFault]:
    """Give the cores of the engines opened in the block ``fault`` for their
    first ``starts`` starts (see the module docstring)."""
    injected = CoreFault(fault, starts)
    token = core_fault.set(injected)
    try:
        yield injected
    finally:
        core_fault.reset(token)
