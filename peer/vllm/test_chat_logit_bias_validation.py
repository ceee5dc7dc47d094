# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/basic/test_chat_logit_bias_validation.py
# (commit 0ccf651ac3f16f87c51197d5aaf06ee6b94d9d37). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.

import openai
import pytest

from peer.conftest import get_tokenizer
from peer.vllm.conftest import MODEL_NAME

# structllm: the shared ``structllm serve tiny`` replaces RemoteOpenAIServer;
# pytest.mark.asyncio -> pytest.mark.anyio.
pytestmark = pytest.mark.anyio


def get_vocab_size(model_name):
    # structllm: vllm.config.ModelConfig(...).get_vocab_size() -> the
    # served model's tokenizer (tiny: 1024 = config.json's vocab_size).
    return get_tokenizer(model_name).vocab_size


async def test_chat_logit_bias_valid(client):
    """Test that valid logit_bias values are accepted in chat completions."""
    vocab_size = get_vocab_size(MODEL_NAME)
    valid_token_id = vocab_size - 1

    completion = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Testing valid logit bias"}],
        max_tokens=5,
        logit_bias={str(valid_token_id): 1.0},
    )

    assert completion.choices[0].message.content is not None


async def test_chat_logit_bias_invalid(client):
    """Test that invalid logit_bias values are rejected in chat completions."""
    vocab_size = get_vocab_size(MODEL_NAME)
    invalid_token_id = vocab_size + 1

    with pytest.raises(openai.BadRequestError) as excinfo:
        await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Testing invalid logit bias"}],
            max_tokens=5,
            logit_bias={str(invalid_token_id): 1.0},
        )

    error = excinfo.value
    error_message = str(error)

    assert error.status_code == 400
    assert str(invalid_token_id) in error_message
    assert str(vocab_size) in error_message
