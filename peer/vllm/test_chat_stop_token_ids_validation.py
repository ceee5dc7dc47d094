# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/chat_completion/test_chat_stop_token_ids_validation.py
# (commit 9f598fa932cfe3237d3fcc01e30b45909792fc04). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.

import openai
import pytest

from peer.conftest import get_tokenizer
from peer.vllm.conftest import MODEL_NAME

# structllm: the shared ``structllm serve tiny`` replaces
# RemoteOpenAIServer("Qwen/Qwen2.5-1.5B-Instruct");
# pytest.mark.asyncio -> pytest.mark.anyio.
pytestmark = pytest.mark.anyio


def get_vocab_size(model_name):
    # structllm: vllm.config.ModelConfig(...).get_vocab_size() -> the
    # served model's tokenizer (tiny: 1024 = config.json's vocab_size).
    return get_tokenizer(model_name).vocab_size


async def test_chat_stop_token_ids_valid(client):
    """Test that valid stop_token_ids are accepted in chat completions."""
    vocab_size = get_vocab_size(MODEL_NAME)
    valid_token_id = vocab_size - 1

    completion = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Testing valid stop token ids"}],
        max_tokens=5,
        extra_body={"stop_token_ids": [valid_token_id]},
    )

    assert completion.choices[0].message.content is not None


async def test_chat_stop_token_ids_invalid(client):
    """Test that out-of-vocab stop_token_ids are rejected."""
    vocab_size = get_vocab_size(MODEL_NAME)
    invalid_token_id = vocab_size + 1

    with pytest.raises(openai.BadRequestError) as excinfo:
        await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Testing invalid stop token ids"}],
            max_tokens=5,
            extra_body={"stop_token_ids": [invalid_token_id]},
        )

    error = excinfo.value
    error_message = str(error)

    assert error.status_code == 400
    assert str(invalid_token_id) in error_message
    assert str(vocab_size) in error_message
