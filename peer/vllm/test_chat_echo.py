# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/basic/test_chat_echo.py
# (commit fa0f818ee338b5aee39c120198651ad80855c51d). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.

import openai  # use the official client for correctness check
import pytest

# structllm: ``server``, ``client`` and ``model_name`` come from
# peer/vllm/conftest.py (upstream: tests/entrypoints/openai/basic/conftest.py).
# pytest.mark.asyncio -> pytest.mark.anyio.
pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("echo", [True, False])
async def test_chat_session_with_echo_and_continue_final_message(
    client: openai.AsyncOpenAI, echo: bool, model_name
):
    saying: str = "Here is a common saying about apple. An apple a day, keeps"
    # test echo with continue_final_message parameter
    # structllm: max_completion_tokens=32 added: tiny seldom ends by itself,
    # and upstream's request has no limit (the rest of the context).
    chat_completion = await client.chat.completions.create(
        model=model_name,
        messages=[
            {"role": "user", "content": "tell me a common saying"},
            {"role": "assistant", "content": saying},
        ],
        max_completion_tokens=32,
        extra_body={
            "echo": echo,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    )
    assert chat_completion.id is not None
    assert len(chat_completion.choices) == 1

    choice = chat_completion.choices[0]
    assert choice.finish_reason in ["stop", "length"]

    message = choice.message
    if echo:
        assert message.content is not None and saying in message.content
    else:
        assert message.content is not None and saying not in message.content
    assert message.role == "assistant"
