"""Check a request's output constraint before it reaches the engine.

:func:`check_constraint` asks llguidance whether a
:class:`~structllm.structured.StructuredOutputs` compiles (without a
vocabulary: ~0.1-2 ms for the schemas requests carry; the engine's
:func:`~structllm.structured.compiler.validate`) and raises
:class:`~structllm.errors.InvalidRequestError` naming the *request's* field
(``response_format.json_schema.schema``, ``tools[0].function.parameters``,
``structured_outputs.regex``), which the engine's own compiler cannot know:
it only sees ``structured_outputs.<kind>``. :func:`check_constraints` runs
the checks of one request in a worker thread (a pathological regex must not
stall the event loop); the request is refused with a 400 before anything is
promised, streaming or not.

:func:`renamed` maps an error the engine raises anyway (what only the
vocabulary reveals) back to the request's field.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import anyio
import anyio.lowlevel
import anyio.to_thread

from structllm.errors import InvalidRequestError, unwrap_group
from structllm.structured import StructuredOutputs
from structllm.structured.compiler import is_validated, validate

__all__ = ["check_constraint", "check_constraints", "rename_field", "renamed"]


def check_constraint(c: StructuredOutputs, field: str) -> None:
    """Raise InvalidRequestError naming ``field`` if ``c`` does not compile.

    :func:`structllm.structured.compiler.validate` remembers the specs it
    passed, so the engine's own check at admission then costs nothing.
    """
    try:
        validate(c)
    except InvalidRequestError as exc:
        raise rename_field(exc, field) from None


async def check_constraints(checks: Sequence[tuple[StructuredOutputs, str]]) -> None:
    """:func:`check_constraint` for each, in a worker thread (the event loop
    serves on while llguidance works); nothing to do for specs it passed."""
    todo = [(c, field) for c, field in checks if not is_validated(c)]
    if not todo:
        return
    await anyio.to_thread.run_sync(_check_all, todo)
    await anyio.lowlevel.checkpoint_if_cancelled()


def _check_all(checks: list[tuple[StructuredOutputs, str]]) -> None:
    for c, field in checks:
        check_constraint(c, field)


def rename_field(exc: InvalidRequestError, field: str | None) -> InvalidRequestError:
    """``exc`` naming ``field`` instead of ``structured_outputs[.kind]``."""
    own = exc.field or ""
    if field is None or field == own or not own.startswith("structured_outputs"):
        return exc
    message = str(exc).replace(own, field, 1)
    return InvalidRequestError(message, field=field)


@contextlib.contextmanager
def renamed(field: str | None) -> Iterator[None]:
    """Errors about the constraint from the engine name ``field`` instead.

    Also inside an exception group (the requests of one response run in a
    task group): a group whose first leaf is such an error is replaced by
    the renamed error.
    """
    try:
        yield
    except InvalidRequestError as exc:
        raise rename_field(exc, field) from None
    except BaseExceptionGroup as group:
        leaf = unwrap_group(group)
        if (
            isinstance(leaf, InvalidRequestError)
            and rename_field(leaf, field) is not leaf
        ):
            raise rename_field(leaf, field) from None
        raise
