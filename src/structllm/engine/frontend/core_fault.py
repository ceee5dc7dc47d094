"""The test fault a front end's cores start with (:mod:`structllm.testing.faults`
sets it; :class:`~structllm.engine.frontend.core_client.CoreClient` reads it)."""

from __future__ import annotations

from contextvars import ContextVar

import attrs

__all__ = ["CoreFault", "core_fault"]


@attrs.frozen
class CoreFault:
    """A test fault for the first ``starts`` cores of a client: ``fault`` is
    ``Start.fault`` ("raise_at_step:N", "hang_at_step:N", "exit_at_step:N",
    "slow_at_step:N", "stall_at_step:N", "rank1:" before one of them for
    tensor-parallel rank 1)."""

    fault: str
    starts: int = attrs.field(default=1, validator=attrs.validators.ge(0))


#: the test fault of the clients built in this context (None: none); set
#: through :func:`structllm.testing.faults.inject_fault`, never a setting
core_fault: ContextVar[CoreFault | None] = ContextVar("core_fault", default=None)
