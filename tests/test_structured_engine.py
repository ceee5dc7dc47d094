"""Constrained decoding end to end: SamplingParams.structured_outputs through
the engine core, ``LLM`` and ``AsyncLLM``, on the random-weight ``tiny`` model.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from structllm import LLM
from structllm.core.request import CoreRequest
from structllm.engine.protocol import decode, encode
from structllm.errors import InvalidRequestError
from structllm.params import SamplingParams
from structllm.structured import StructuredOutputs
from tests.strategies import json_schemas

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


# --- end to end: LLM ------------------------------------------------------------

ENGINE: dict[str, Any] = {"max_model_len": 512}
#: near-uniform over what the grammar allows: a random-weight model otherwise
#: repeats one digit of an unbounded number until max_tokens
HOT = 10.0

#: unconstrained requests batched with the constrained ones
FREE_PROMPTS = ["hello", "The sky is", "{"]
FREE = [
    SamplingParams(max_tokens=24, seed=7),
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=24, seed=8, top_k=20, top_p=0.9, temperature=0.8),
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", show_progress=False, **ENGINE)


@pytest.fixture(scope="module")
def free_reference(llm: LLM) -> list[list[int]]:
    """The unconstrained requests' tokens, each run alone."""
    return [
        list(llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids)
        for p, params in zip(FREE_PROMPTS, FREE, strict=True)
    ]


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[Any]:
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_idle(llm: LLM) -> None:
    core = llm.core
    assert not core.has_unfinished_requests()
    assert core.pool.num_used == 0
    assert core.structured.num_compiling == 0


@settings(
    max_examples=8,  # x 25 schemas: 200 per run
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    schemas=st.lists(json_schemas, min_size=25, max_size=25),
    seed=st.integers(0, 2**32 - 1),
)
def test_generated_schemas_validate_batched_with_free_requests(
    llm: LLM,
    free_reference: list[list[int]],
    schemas: list[dict[str, Any]],
    seed: int,
) -> None:
    constrained = [
        SamplingParams(
            max_tokens=400,
            temperature=HOT,
            seed=seed + i,
            structured_outputs=StructuredOutputs(json=schema),
        )
        for i, schema in enumerate(schemas)
    ]
    prompts = [f"{i}: " for i in range(len(schemas))]
    outs = run(llm, [*FREE_PROMPTS, *prompts], [*FREE, *constrained])
    for out, expected in zip(outs, free_reference, strict=False):
        assert list(out.token_ids) == expected
    for out, schema in zip(outs[len(FREE) :], schemas, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert_idle(llm)
