"""``speculative_config``: vLLM's form, checked when the config is built, by
``LLM``/``AsyncLLM.open`` keywords and ``--speculative-config JSON`` alike."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from structllm.cli import build_parser, engine_args
from structllm.config import EngineConfig, SpeculativeConfig
from structllm.errors import EngineConfigError

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
DRAFT = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 4}


def test_vllm_dict_and_its_defaults() -> None:
    config = EngineConfig(model="m", speculative_config=NGRAM)
    assert config.speculative_config == SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=3,
        prompt_lookup_min=2,
        prompt_lookup_max=5,
        disable_by_batch_size=1,
    )
    # one bound given: the other takes its value, as vLLM does
    one = SpeculativeConfig.from_dict({**NGRAM, "prompt_lookup_max": 4})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    one = SpeculativeConfig.from_dict({**NGRAM, "prompt_lookup_min": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    full = {
        **NGRAM,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 6,
        "disable_by_batch_size": None,
    }
    assert EngineConfig(model="m", speculative_config=full).speculative_config == (
        SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=3,
            prompt_lookup_min=1,
            prompt_lookup_max=6,
            disable_by_batch_size=None,
        )
    )
    assert EngineConfig(model="m").speculative_config is None


def test_a_draft_model_in_vllm_form() -> None:
    want = SpeculativeConfig(
        method="draft_model", model="tiny", num_speculative_tokens=4
    )
    assert EngineConfig(model="m", speculative_config=DRAFT).speculative_config == (
        want
    )
    # a model and no method: a draft model, as vLLM infers it
    inferred = {"model": "tiny", "num_speculative_tokens": 4}
    assert SpeculativeConfig.from_dict(inferred) == want
    assert want.prompt_lookup_min is None and want.disable_by_batch_size == 1


def test_crosses_to_the_core_process_unchanged() -> None:
    for spec in (NGRAM, DRAFT):
        config = EngineConfig(model="m", speculative_config=spec)
        wire = msgspec.msgpack.encode(config)
        assert msgspec.msgpack.decode(wire, type=EngineConfig) == config


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model (the draft"),
        ({**DRAFT, "model": ""}, "model (the draft"),
        ({**DRAFT, "prompt_lookup_max": 3}, "prompt_lookup_max is for method 'ngram'"),
        ({**NGRAM, "model": "x"}, "model is for method 'draft_model'"),
        ({"model": "x"}, "num_speculative_tokens is required"),
        ({**DRAFT, "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle'"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        (
            {**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_max",
        ),
        ({**NGRAM, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({**NGRAM, "lookahead": 2}, "unknown key 'lookahead'"),
        ("{not json", "not valid JSON"),
        (3, "must be a dict"),
    ],
)
def test_refused_naming_the_field(value: Any, words: str) -> None:
    with pytest.raises(EngineConfigError, match="speculative_config") as info:
        EngineConfig(model="m", speculative_config=value)
    assert info.value.field == "speculative_config"
    assert words in str(info.value)


def test_command_line_flag_takes_json() -> None:
    text = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    for command in (["serve", "m"], ["generate", "m", "p"]):
        ns = build_parser().parse_args([*command, "--speculative-config", text])
        config = EngineConfig(model="m", **engine_args(ns))
        assert config.speculative_config == SpeculativeConfig.from_dict(
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
        )
    text = '{"method": "draft_model", "model": "tiny", "num_speculative_tokens": 4}'
    ns = build_parser().parse_args(["serve", "m", "--speculative-config", text])
    config = EngineConfig(model="m", **engine_args(ns))
    assert config.speculative_config == SpeculativeConfig.from_dict(DRAFT)
    ns = build_parser().parse_args(["serve", "m"])
    assert EngineConfig(model="m", **engine_args(ns)).speculative_config is None


def test_a_bad_flag_stops_the_command_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from structllm.cli import main

    argv = ["generate", "m", "p", "--speculative-config", '{"method": "eagle"}']
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "speculative_config" in err
    assert "Traceback" not in err
