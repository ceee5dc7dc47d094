"""RoPE scaling against an oracle that shares no code with ``model/``.

Two independent sources agree, then the model agrees with them:

- closed forms written from the published definitions (linear, dynamic,
  llama3, yarn: ``tests/reference.py::rope_frequencies``), and
- values recorded from transformers' ``ROPE_INIT_FUNCTIONS`` by
  ``tools/record_rope_oracle.py`` (``tests/data/rope_transformers.json``
  says which versions and how to record them again).

The paged forward is checked against the reference forward, which uses the
closed forms, in ``tests/test_model.py`` (configs with each scaling).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from structllm.model.config import ModelConfig, RopeScaling, tiny_random_config
from structllm.model.llama import rope_attention_factor, rope_inv_freq
from tests.reference import reference_rope, rope_frequencies

RECORDED = json.loads(
    (Path(__file__).parent / "data" / "rope_transformers.json").read_text()
)
CASES: dict[str, dict[str, Any]] = RECORDED["cases"]


def model_config(case: dict[str, Any]) -> ModelConfig:
    d, heads = case["head_dim"], 4
    return attrs.evolve(
        tiny_random_config(),
        hidden_size=d * heads,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=d,
        rope_theta=case["rope_theta"],
        max_position_embeddings=case["max_position_embeddings"],
        rope_scaling=RopeScaling.from_hf(
            case["rope_scaling"],
            max_position_embeddings=case["max_position_embeddings"],
        ),
    )


def test_every_scaling_is_recorded() -> None:
    kinds = {c["rope_scaling"]["rope_type"] for c in CASES.values()}
    assert kinds == {"linear", "dynamic", "llama3", "yarn"}


@pytest.mark.parametrize("name", list(CASES))
def test_the_closed_forms_match_transformers(name: str) -> None:
    case = CASES[name]
    inv, scale = rope_frequencies(
        case["head_dim"],
        case["rope_theta"],
        case["max_position_embeddings"],
        case["rope_scaling"],
    )
    # transformers computes in float32
    np.testing.assert_allclose(inv, case["inv_freq"], rtol=2e-6)
    assert scale == pytest.approx(case["attention_factor"], rel=1e-9)


@pytest.mark.parametrize("name", list(CASES))
def test_the_models_rope_matches_the_oracle(name: str) -> None:
    case = CASES[name]
    config = model_config(case)
    inv, scale = reference_rope(config)
    np.testing.assert_allclose(rope_inv_freq(config), inv, rtol=1e-12)
    np.testing.assert_allclose(rope_inv_freq(config), case["inv_freq"], rtol=2e-6)
    assert rope_attention_factor(config) == pytest.approx(scale, rel=1e-12)
    assert rope_attention_factor(config) == pytest.approx(
        case["attention_factor"], rel=1e-9
    )


def test_the_scalings_differ_from_plain_rope() -> None:
    """Each recorded case changes the frequencies or the factor: an oracle
    that matched plain RoPE would check nothing."""
    for case in CASES.values():
        plain, _ = rope_frequencies(
            case["head_dim"], case["rope_theta"], case["max_position_embeddings"], None
        )
        kind = case["rope_scaling"]["rope_type"]
        differs = not np.allclose(plain, case["inv_freq"], rtol=1e-5)
        assert differs or kind == "dynamic"  # dynamic: plain inside max_pos
