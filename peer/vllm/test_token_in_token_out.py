# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/completion/test_token_in_token_out.py
# (commit 2fb36e4d6e69cfbb19b0c71f992bd7fff1beaf1d). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.

import pytest

from peer.conftest import get_tokenizer
from peer.vllm.conftest import MODEL_NAME

# structllm: upstream serves Qwen/Qwen3-0.6B's config with dummy weights and
# --skip-tokenizer-init (the server never loads a tokenizer, so the test
# checks token ids only). structllm always loads the model's tokenizer: the
# shared ``structllm serve tiny`` answers the same token-id prompt, and the
# test's claims (token ids in and out) do not depend on it.
# pytest.mark.asyncio -> pytest.mark.anyio.
pytestmark = pytest.mark.anyio


async def test_token_in_token_out_and_logprobs(server):
    """
    Test token-in-token-out and token_ids align with prompt_logprobs
    & logprobs when return_tokens_as_token_ids is enabled.
    """
    tokenizer = get_tokenizer(tokenizer_name=MODEL_NAME)
    text = "Hello, world! How are you today?"
    token_ids = tokenizer.encode(text)
    async with server.get_async_client() as client:
        # Test with both return_token_ids and return_tokens_as_token_ids enabled
        completion = await client.completions.create(
            model=MODEL_NAME,
            prompt=token_ids,
            max_tokens=20,
            temperature=0,
            echo=True,
            extra_body={
                "return_token_ids": True,
            },
        )

        # Verify all fields are present
        assert (
            completion.choices[0].token_ids is not None
            and 0 < len(completion.choices[0].token_ids) <= 20
        )
        assert completion.choices[0].prompt_token_ids is not None

        # Decode prompt tokens
        if completion.choices[0].prompt_token_ids:
            prompt_text = tokenizer.decode(completion.choices[0].prompt_token_ids)
            # The decoded prompt should match or close to original prompt
            assert prompt_text == text
