"""The built-in model names: "tiny" (trained, real files) and "tiny-random"."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from structllm import LLM, SamplingParams
from structllm.model._paddle import paddle
from structllm.model.loader import load_model
from structllm.model.training import causal_lm_loss
from structllm.models import TINY, TINY_RANDOM, resolve_model
from structllm.text import ByteTokenizer, HFTokenizer, load_tokenizer
from tests.tool_modules import load_tool

#: MIT licence text, as the trained model learned it
MIT = "Permission is hereby granted"
MIT_NEXT = ", free of charge, to any person obtaining a copy"


def test_names_resolve() -> None:
    tiny = resolve_model(TINY)
    assert tiny is not None and (tiny / "model.safetensors").is_file()
    assert (tiny / "tokenizer.json").is_file()
    assert resolve_model(TINY_RANDOM) is None
    assert resolve_model("./some/dir") == Path("some/dir")


def test_each_name_has_its_own_tokenizer() -> None:
    assert isinstance(load_tokenizer(TINY_RANDOM), ByteTokenizer)
    tok = load_tokenizer(TINY)
    assert isinstance(tok, HFTokenizer)
    assert tok.decode(tok.encode(MIT, add_special_tokens=False)) == MIT


@pytest.mark.parametrize(
    "prompt, continuation",
    [
        (MIT, MIT_NEXT),
        ("THE SOFTWARE IS PROVIDED", ' "AS IS", WITHOUT WARRANTY OF ANY KIND'),
    ],
)
def test_tiny_writes_the_text_it_was_trained_on(prompt: str, continuation: str) -> None:
    llm = LLM(TINY, show_progress=False, max_model_len=256, num_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=16)
    text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    assert text.startswith(continuation), text


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


#: a few prompts a newcomer might try
PROMPTS = [MIT, "Return the", "THE SOFTWARE IS PROVIDED", "Hello, world"]


def test_greedy_text_is_stable_and_valid_utf8() -> None:
    llm = LLM(TINY, show_progress=False, max_model_len=256, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=24)
    batched = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for prompt, out in zip(PROMPTS, batched, strict=True):
        alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == out.token_ids, prompt  # batching changes nothing
        assert "\ufffd" not in out.text, (prompt, out.text)  # whole characters
        assert out.text.strip(), prompt


def test_held_out_perplexity_matches_training_json() -> None:
    """The shipped weights score the held-out documents as training recorded."""
    train_tiny = load_tool("train_tiny")
    _, held_out, digest = train_tiny.documents()  # type: ignore[attr-defined]
    directory = resolve_model(TINY)
    assert directory is not None
    record = json.loads((directory / "training.json").read_text())
    assert digest == record["corpus_sha256"]
    # encoded exactly as tools/train_tiny.py encodes it
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for e in tok.encode_batch(held_out):
        ids += [*e.ids, eot]
    context = record["settings"]["context"]
    n = (len(ids) - 1) // context
    rows = np.stack(
        [np.asarray(ids[i * context : i * context + context + 1]) for i in range(n)]
    )

    def ppl(load_format: str) -> float:
        model = load_model(TINY, load_format=load_format).model  # type: ignore[arg-type]
        with paddle.no_grad():
            return math.exp(float(causal_lm_loss(model, paddle.to_tensor(rows))))

    trained, random = ppl("auto"), ppl("dummy")
    # float16 weights in the checkpoint, float32 in training: close, not equal
    assert trained == pytest.approx(record["held_out_perplexity"], rel=0.05)
    assert trained < 10 < 500 < random, (trained, random)
