"""Hypothesis strategies for the engine core's pure parts, and JSON Schemas.

Each strategy draws a small frozen attrs value describing *what* to build;
the tests turn it into the real objects, so a failing example prints as a
readable value rather than as a pile of mutable state.
"""

from __future__ import annotations

from typing import Any

import attrs
from hypothesis import strategies as st

__all__ = [
    "EOS_TOKEN_ID",
    "VOCAB_SIZE",
    "RequestSpec",
    "SchedulerSetup",
    "json_schemas",
    "request_specs",
    "scheduler_setups",
]

#: the fake model's vocabulary; small, so that EOS and stop ids turn up often
VOCAB_SIZE = 16
EOS_TOKEN_ID = 0


@attrs.frozen(kw_only=True)
class SchedulerSetup:
    """A scheduler and pool small enough that preemption is common.

    As ``EngineCore`` guarantees, one sequence of ``max_model_len`` tokens
    always fits in the pool: ``num_blocks * block_size >= max_model_len``.
    """

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def __attrs_post_init__(self) -> None:
        if not 2 <= self.max_model_len <= self.num_blocks * self.block_size:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must be in "
                f"[2, num_blocks * block_size = {self.num_blocks * self.block_size}]"
            )


@st.composite
def scheduler_setups(draw: st.DrawFn) -> SchedulerSetup:
    num_blocks = draw(st.integers(4, 24))
    block_size = draw(st.integers(1, 8))
    capacity = num_blocks * block_size
    return SchedulerSetup(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 40)),
        # favour lengths close to the pool's capacity: that is where it is tight
        max_model_len=draw(
            st.one_of(
                st.integers(2, capacity),
                st.integers(max(2, capacity - block_size), capacity),
            )
        ),
    )


@attrs.frozen(kw_only=True)
class RequestSpec:
    """One request as a front end would submit it (prompt by length only)."""

    prompt_len: int
    #: None: run to the context length
    max_tokens: int | None = 16
    min_tokens: int = 0
    priority: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    #: prompts of the same variant share all their tokens, of different
    #: variants the first ``SHARED_PREFIX`` (see tests.test_scheduler)
    prompt_variant: int = 0
    cache_salt: str | None = None


@st.composite
def request_specs(
    draw: st.DrawFn, max_model_len: int, *, long: bool = False
) -> RequestSpec:
    """A valid request for ``max_model_len``; ``long`` prompts fill most of it."""
    lo = max(1, (max_model_len - 1) * 3 // 4) if long else 1
    prompt_len = draw(st.integers(lo, max_model_len - 1))
    max_tokens = draw(
        st.none() | st.integers(1, 4) | st.integers(1, max_model_len)
        if not long
        else st.none() | st.integers(1, max_model_len)
    )
    min_tokens = draw(st.integers(0, max_tokens or 3) | st.just(0))
    return RequestSpec(
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        priority=draw(st.integers(0, 2)),
        stop_token_ids=tuple(
            draw(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=2, unique=True))
        ),
        ignore_eos=draw(st.booleans()),
        prompt_variant=draw(st.integers(0, 2)),
        cache_salt=draw(st.sampled_from([None, None, "tenant-a", "tenant-b"])),
    )


# --- JSON Schemas (structured output) -----------------------------------------

# Bounded so that a random model finishes: short strings, few items, closed
# objects (additionalProperties false), shallow nesting.
_leaves: st.SearchStrategy[dict[str, Any]] = st.one_of(
    st.builds(
        lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
        st.integers(0, 2),
        st.integers(0, 5),
    ),
    st.builds(
        lambda lo: {"type": "integer", **lo},
        st.sampled_from([{}, {"minimum": 0}, {"minimum": -5, "maximum": 5}]),
    ),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(
        st.one_of(st.text('abcé"\\ ', max_size=4), st.integers(-3, 3)),
        min_size=1,
        max_size=4,
        unique=True,
    ).map(lambda values: {"enum": values}),
    st.text("xyz", max_size=3).map(lambda v: {"const": v}),
)


def _object(props: dict[str, dict[str, Any]], required: list[bool]) -> dict[str, Any]:
    names = list(props)
    return {
        "type": "object",
        "properties": props,
        "required": [n for n, r in zip(names, required, strict=False) if r],
        "additionalProperties": False,
    }


def _extend(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
    names = st.text("abcdefgh_", min_size=1, max_size=5)
    return st.one_of(
        st.builds(
            lambda items, n: {"type": "array", "items": items, "maxItems": n},
            children,
            st.integers(0, 3),
        ),
        st.builds(
            _object,
            st.dictionaries(names, children, max_size=4),
            st.lists(st.booleans(), min_size=4, max_size=4),
        ),
        st.lists(children, min_size=2, max_size=3).map(lambda s: {"anyOf": s}),
    )


json_schemas = st.recursive(_leaves, _extend, max_leaves=8)
