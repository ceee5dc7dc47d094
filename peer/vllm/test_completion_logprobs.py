# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/completion/test_completion_logprobs.py
# (commit 9fb12f26cc03df0a4ceddfcc47c941637f3566a3). What changed and why:
# peer/vllm/NOTES.md.
# structllm: upstream calls vLLM's OpenAIServingCompletion._create_completion_logprobs
# with a mocked tokenizer and a step whose top-logprobs dict lacks the sampled
# token, and checks that the completion path does not raise KeyError. The
# HTTP form of that case: a completion sampled at a high temperature with
# logprobs=1, so that sampled tokens fall outside the top 1. structllm always
# has the sampled token's logprob (upstream's None entries are for vLLM's
# engine leaving it out), so the claim checked is vLLM's usual answer: the
# sampled token is in its position's top_logprobs, with its own logprob.

import httpx

from peer.conftest import StructllmServer
from peer.vllm.conftest import MODEL_NAME


def test_completion_logprobs_handles_sampled_token_absent_from_step(
    server: StructllmServer,
):
    res = httpx.post(
        server.url_for("v1/completions"),
        json={
            "model": MODEL_NAME,
            "prompt": "Hello",
            "max_tokens": 8,
            "temperature": 5.0,
            "seed": 1,
            "logprobs": 1,
        },
        timeout=60,
    )
    assert res.status_code == 200, res.text
    choice = res.json()["choices"][0]
    result = choice["logprobs"]
    count = res.json()["usage"]["completion_tokens"]

    assert len(result["tokens"]) == count
    assert len(result["token_logprobs"]) == count
    assert len(result["top_logprobs"]) == count
    outside_top = 0
    for token, logprob, top in zip(
        result["tokens"], result["token_logprobs"], result["top_logprobs"], strict=True
    ):
        assert top[token] == logprob
        best = max(top.values())
        outside_top += logprob < best
        assert len(top) <= 2
    # the case upstream is about happened: a sampled token not in the top 1
    assert outside_top > 0
