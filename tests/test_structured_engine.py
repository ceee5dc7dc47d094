"""Constrained decoding end to end: SamplingParams.structured_outputs through
the engine core, ``LLM`` and ``AsyncLLM``, on the random-weight ``tiny`` model.
"""

from __future__ import annotations

from typing import Any

import pytest

from structllm.core.request import CoreRequest
from structllm.engine.protocol import decode, encode
from structllm.errors import InvalidRequestError
from structllm.params import SamplingParams
from structllm.structured import StructuredOutputs

# --- the field and the wire -------------------------------------------------

CONSTRAINTS = [
    StructuredOutputs(
        json={"type": "object", "properties": {"a": {"type": "integer"}}}
    ),
    StructuredOutputs(json_object=True),
    StructuredOutputs(regex=r"[a-z]{2,5}\d"),
    StructuredOutputs(choice=["yes", "no", "maybe"]),
    StructuredOutputs(grammar='start: "a" start | "b"'),
]


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind)
def test_structured_outputs_round_trip_the_core_socket(
    constraint: StructuredOutputs,
) -> None:
    params = SamplingParams(max_tokens=9, seed=3, structured_outputs=constraint)
    request = CoreRequest(request_id="r#0", prompt_token_ids=(1, 2), params=params)
    back = decode(encode(request)[4:])
    assert isinstance(back, CoreRequest)
    assert back.params == params
    so = back.params.structured_outputs
    assert isinstance(so, StructuredOutputs)
    assert so.key == constraint.key
    assert so.kind == constraint.kind


def test_plain_params_still_round_trip_without_a_constraint() -> None:
    request = CoreRequest(
        request_id="r", prompt_token_ids=(1,), params=SamplingParams()
    )
    back = decode(encode(request)[4:])
    assert isinstance(back, CoreRequest)
    assert back.params.structured_outputs is None


@pytest.mark.parametrize("value", [{"json": {}}, "json", 3])
def test_structured_outputs_must_be_the_type(value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(structured_outputs=value)
    assert info.value.field == "structured_outputs"
