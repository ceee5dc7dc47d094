# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/chat_completion/test_token_in_token_out.py
# (commit 49d9f165f6fcd42c26b100765c0d21fd44f5228e). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.
# structllm: renamed from test_token_in_token_out.py (the completion suite's
# file of that name is peer/vllm/test_token_in_token_out.py).
"""Pre-tokenized input (token-in, text-out) on the chat completions API."""

import openai
import pytest
import requests

from peer.conftest import StructllmServer
from peer.vllm.conftest import MODEL_NAME

# structllm: upstream serves Qwen/Qwen3-0.6B's tokenizer and config with
# dummy weights (--load-format dummy, downloaded); the shared ``structllm
# serve tiny`` has trained weights, which the claims (the same ids give the
# same greedy answer) do not need. MODEL_PATH -> MODEL_NAME.
# pytest.mark.asyncio -> pytest.mark.anyio.
pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "Hello, how are you today?"}]


def _render_prompt_token_ids(server: StructllmServer) -> list[int]:
    """Ask the server for the token ids it would produce for MESSAGES."""
    resp = requests.post(
        server.url_for("tokenize"),
        json={"model": MODEL_NAME, "messages": MESSAGES},
    )
    resp.raise_for_status()
    return resp.json()["tokens"]


@pytest.mark.xfail(
    reason="not implemented: chat's prompt_token_ids (vLLM's pre-tokenized "
    "chat input) is refused (400 naming it)",
    strict=True,
)
async def test_chat_token_in_matches_messages(server):
    """prompt_token_ids drives generation identically to the templated path."""
    prompt_token_ids = _render_prompt_token_ids(server)

    async with server.get_async_client() as client:
        baseline = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_completion_tokens=16,
            temperature=0,
        )
        token_in = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[],
            max_completion_tokens=16,
            temperature=0,
            extra_body={
                "prompt_token_ids": prompt_token_ids,
                "return_token_ids": True,
            },
        )

    # text-out: pre-tokenized input still yields a detokenized message.
    assert token_in.choices[0].message.content is not None
    # the engine saw exactly the ids we supplied.
    assert token_in.prompt_token_ids == prompt_token_ids
    # equivalence: identical prompt tokens -> identical greedy completion.
    assert token_in.choices[0].message.content == baseline.choices[0].message.content


async def test_chat_token_in_rejects_template_option(server):
    """Chat-template options are incompatible with pre-tokenized input."""
    prompt_token_ids = _render_prompt_token_ids(server)
    async with server.get_async_client() as client:
        # structllm: the 400 names messages (empty), since prompt_token_ids
        # is refused (the xfail above); the request is refused either way
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model=MODEL_NAME,
                messages=[],
                max_completion_tokens=4,
                extra_body={
                    "prompt_token_ids": prompt_token_ids,
                    "add_generation_prompt": True,
                },
            )
