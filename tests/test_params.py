"""SamplingParams: every invalid value is refused, naming the field."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from structllm import InvalidRequestError, OutputKind, SamplingParams

BAD = [
    ("max_tokens", 0),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("temperature", -0.1),
    ("temperature", "hot"),
    ("temperature", float("nan")),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("min_p", 1.5),
    ("seed", 2**64),
    ("seed", "1"),
    ("stop", [1]),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", "12"),
    ("stop_token_ids", [2**64]),
    ("stop", ["ok", "\ud800"]),
    ("max_tokens", 2**64),
    ("min_tokens", 2**64),
    ("top_k", 2**64),
    ("logit_bias", {"5": 101}),
    ("logit_bias", {"5": float("nan")}),
    ("logit_bias", {"x": 1}),
    ("logit_bias", {-1: 1}),
    ("logit_bias", {"99999999999999999999": 1}),
    ("logit_bias", "5"),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [2**31]),
    ("allowed_token_ids", [True]),
    ("ignore_eos", 1),
    ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3),
    ("logprobs", 21),
    ("logprobs", -1),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", True),
    ("output_kind", "stream"),
    ("skip_special_tokens", None),
    ("n", 0),
    ("n", 1025),
    ("n", 2.0),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_invalid_value_names_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field
    assert field in str(e.value)
    assert isinstance(e.value, ValueError)


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(InvalidRequestError, match="min_tokens") as e:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert e.value.field == "min_tokens"


def test_normalisation() -> None:
    p = SamplingParams(temperature=1, top_k=-1, stop="x", output_kind="delta")
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert p.top_k == 0 and p.stop == ("x",) and p.output_kind is OutputKind.DELTA
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy


@given(
    temperature=st.floats(0, 100),
    top_p=st.floats(0, 1, exclude_min=True),
    min_p=st.floats(0, 1),
    top_k=st.integers(-1, 1000),
)
def test_valid_values_accepted(
    temperature: float, top_p: float, min_p: float, top_k: int
) -> None:
    p = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k)
    assert p.top_k >= 0


def test_logit_bias_and_allowed_ids_normalised() -> None:
    p = SamplingParams(logit_bias={"7": 1, 3: -2.5}, allowed_token_ids=[9, 2, 9])
    assert p.logit_bias == ((3, -2.5), (7, 1.0))
    assert p.allowed_token_ids == (2, 9)
    assert SamplingParams(logit_bias=[[7, 1.0], [3, -2.5]]).logit_bias == p.logit_bias


def test_for_choice_gives_each_sample_its_own_seed() -> None:
    p = SamplingParams(n=3, seed=2**63 - 1, temperature=0.5)
    seeds = [p.for_choice(i).seed for i in range(3)]
    assert seeds == [2**63 - 1, 0, 1]  # distinct, and wrapped into 63 bits
    assert {p.for_choice(i).n for i in range(3)} == {1}
    assert SamplingParams(n=2).for_choice(1).seed is None  # unseeded stays so
