"""model/training.py: the training forward is the serving model's forward.

A model trained with it must serve exactly as it trained, so the dense causal
forward and the engine's paged one must agree on logits; the weights must
survive the trip to Hugging Face tensors and back; and training must learn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from structllm import LLM, SamplingParams
from structllm.model._paddle import paddle
from structllm.model.config import ModelConfig, tiny_random_config
from structllm.model.loader import build_model
from structllm.model.training import (
    causal_lm_logits,
    causal_lm_loss,
    hf_tensors,
    initial_hf_tensors,
    trainable_weights,
)
from structllm.testing.checkpoints import make_tiny_model

#: llama with GQA and a tied head; Qwen2's qkv biases with an untied head;
#: Qwen3's q/k norms: between them every kind of tensor
KINDS = {
    "llama": {"arch": "llama", "tie_word_embeddings": True},
    "qwen2-untied": {"arch": "qwen2", "tie_word_embeddings": False},
    "qwen3": {"arch": "qwen3"},
}


def _checkpoint(kind: str, directory: Path) -> ModelConfig:
    """A tiny checkpoint of ``kind`` (its random weights are replaced)."""
    return make_tiny_model(directory, vocab_size=300, **KINDS[kind])  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", KINDS)
def test_hf_tensors_round_trip(kind: str, tmp_path: Path) -> None:
    config = _checkpoint(kind, tmp_path)
    start = initial_hf_tensors(config, seed=1)
    rng = np.random.default_rng(2)
    start = {
        n: t + 0.1 * rng.standard_normal(t.shape, np.float32) for n, t in start.items()
    }
    model = build_model(config, dict(start), max_model_len=64)
    again = hf_tensors(config, model)
    assert set(again) == set(start)
    for name, t in start.items():
        np.testing.assert_array_equal(again[name], t, err_msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_training_logits_equal_the_engines(kind: str, tmp_path: Path) -> None:
    directory = tmp_path / "m"
    config = _checkpoint(kind, directory)
    tensors = initial_hf_tensors(config, seed=3)
    rng = np.random.default_rng(4)
    # larger than the training init, so logits are well separated
    tensors = {
        n: t + 0.3 * rng.standard_normal(t.shape, np.float32)
        for n, t in tensors.items()
    }
    model = build_model(config, dict(tensors), max_model_len=64)

    safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"))
    llm = LLM(str(directory), num_threads=1)
    prompt = [5, 17, 99, 3, 250, 42, 8, 299]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]

    tokens = list(prompt)
    logprobs = []
    with paddle.no_grad():
        for _ in range(12):
            logits = causal_lm_logits(model, paddle.to_tensor([tokens]))[0, -1]
            lp = paddle.nn.functional.log_softmax(logits).numpy()
            tokens.append(int(lp.argmax()))
            logprobs.append(float(lp.max()))
    assert list(out.token_ids) == tokens[len(prompt) :]
    served = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
    np.testing.assert_allclose(served, logprobs, atol=1e-4)


def test_training_learns_a_repeated_text() -> None:
    config = tiny_random_config()
    model = build_model(config, initial_hf_tensors(config, seed=0), max_model_len=128)
    params = trainable_weights(model)
    opt = paddle.optimizer.AdamW(learning_rate=3e-3, parameters=params)
    text = b"Permission is hereby granted, free of charge, to any person. " * 8
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(30):
        starts = rng.integers(0, len(ids) - 33, size=4)
        batch = paddle.to_tensor(np.stack([ids[s : s + 33] for s in starts]))
        loss = causal_lm_loss(model, batch)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    assert losses[0] > np.log(200)  # starts near uniform over 258 ids
    assert np.mean(losses[-5:]) < 0.6 * losses[0]
