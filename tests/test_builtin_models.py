"""The built-in model names: "tiny" (trained, real files) and "tiny-random"."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from structllm import LLM, SamplingParams
from structllm.model._paddle import paddle
from structllm.model.loader import load_model
from structllm.model.training import causal_lm_loss
from structllm.models import TINY, TINY_RANDOM, model_directory
from structllm.text import ByteTokenizer, HFTokenizer, load_tokenizer

#: MIT licence text, as the trained model learned it
MIT = "Permission is hereby granted"
MIT_NEXT = ", free of charge, to any person obtaining a copy"


def test_names_resolve() -> None:
    tiny = model_directory(TINY)
    assert tiny is not None and (tiny / "model.safetensors").is_file()
    assert (tiny / "tokenizer.json").is_file()
    assert model_directory(TINY_RANDOM) is None
    assert model_directory("some/dir") == Path("some/dir")


def test_each_name_has_its_own_tokenizer() -> None:
    assert isinstance(load_tokenizer(TINY_RANDOM), ByteTokenizer)
    tok = load_tokenizer(TINY)
    assert isinstance(tok, HFTokenizer)
    assert tok.decode(tok.encode(MIT, add_special_tokens=False)) == MIT


def test_tiny_writes_the_text_it_was_trained_on() -> None:
    llm = LLM(TINY, show_progress=False, max_model_len=256, num_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=16)
    text = llm.generate([MIT], params, use_tqdm=False)[0].outputs[0].text
    assert text.startswith(MIT_NEXT), text


def _perplexity(model: str, load_format: str, text: str) -> float:
    loaded = load_model(model, load_format=load_format)  # type: ignore[arg-type]
    tok = load_tokenizer(model)
    ids = tok.encode(text, add_special_tokens=False)
    with paddle.no_grad():
        loss = causal_lm_loss(loaded.model, paddle.to_tensor([ids]))
    return math.exp(float(loss))


@pytest.mark.parametrize(
    "text",
    [
        'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, '
        "EXPRESS OR IMPLIED.",
        "Return the number of items in the list, or raise an error if it is empty.",
    ],
)
def test_trained_weights_beat_random_ones(text: str) -> None:
    trained = _perplexity(TINY, "auto", text)
    random = _perplexity(TINY, "dummy", text)  # same config, random weights
    assert trained < random / 10, (trained, random)
