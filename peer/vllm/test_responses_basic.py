# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm after vllm-project/vllm
# tests/entrypoints/openai/responses/test_basic.py
# (commit 41c5903d049b80b83a6e570f52f0f55e31316e49): the same tests, written
# for structllm (here test_responses_basic.py). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.
# structllm: upstream serves a reasoning model and checks its arithmetic
# ("312", "30", "QED"); tiny is not one, so the answers are checked for
# non-empty text, and the reasoning item (qwen3 / deepseek_r1 parsers) is
# tested in tests/test_responses_api.py.

import openai  # use the official client for correctness check
import openai.types.responses as types
import pytest

# structllm: ``client`` and ``model_name`` come from peer/vllm/conftest.py;
# pytest.mark.asyncio -> pytest.mark.anyio.
pytestmark = pytest.mark.anyio


def _answer(response) -> str:
    last = response.output[-1]
    assert last.type == "message"
    return last.content[0].text


async def test_simple_input(client: openai.AsyncOpenAI, model_name):
    response = await client.responses.create(model=model_name, input="What is 13 * 24?")
    # structllm: "312" in the answer -> an answer
    assert _answer(response).strip()


async def test_instructions(client: openai.AsyncOpenAI, model_name):
    response = await client.responses.create(
        model=model_name,
        instructions="Finish the answer with QED.",
        input="What is 13 * 24?",
    )
    assert _answer(response).strip()  # structllm: "312" and "QED" -> an answer
    assert response.instructions == "Finish the answer with QED."


async def test_chat(client: openai.AsyncOpenAI, model_name):
    response = await client.responses.create(
        model=model_name,
        input=[
            {"role": "system", "content": "Finish the answer with QED."},
            {"role": "user", "content": "What is 5 * 3?"},
            {"role": "assistant", "content": "15. QED."},
            {"role": "user", "content": "Multiply the result by 2."},
        ],
    )
    assert _answer(response).strip()  # structllm: "30" and "QED" -> an answer


async def test_chat_with_input_type(client: openai.AsyncOpenAI, model_name):
    response = await client.responses.create(
        model=model_name,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello!"}]}],
        max_output_tokens=32,  # structllm: upstream: the rest of the context
    )
    # structllm: tiny seldom stops by itself: the response finished, completed
    # or cut by max_output_tokens
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[-1].content[0].type == "output_text"


@pytest.mark.xfail(
    reason="not implemented: logprobs on /v1/responses (include, top_logprobs "
    "are refused with a 400 naming them)",
    strict=True,
)
async def test_logprobs(client: openai.AsyncOpenAI, model_name):
    response = await client.responses.create(
        model=model_name,
        include=["message.output_text.logprobs"],
        input="What is 13 * 24?",
        top_logprobs=5,
    )
    logprobs = response.output[-1].content[-1].logprobs
    assert logprobs and len(logprobs[0].top_logprobs) == 5


async def test_streaming(client: openai.AsyncOpenAI, model_name):
    stream = await client.responses.create(
        model=model_name, input="What is 13 * 24?", stream=True
    )
    events = [event async for event in stream]
    assert isinstance(events[0], types.ResponseCreatedEvent)
    assert any(isinstance(e, types.ResponseTextDeltaEvent) for e in events)
    assert isinstance(events[-1], types.ResponseCompletedEvent)
