# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/basic/test_basic.py
# (commit 35daaf4dd032917896c665abc01dedd7bb4a0ad8). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.

import asyncio
from http import HTTPStatus

import openai
import pytest
import requests

import structllm
from peer.conftest import StructllmServer
from peer.vllm.conftest import MODEL_NAME

# structllm: RemoteOpenAIServer("hmellor/tiny-random-LlamaForCausalLM") ->
# the shared ``structllm serve tiny``. The ``server_args`` parametrisation
# (--disable-frontend-multiprocessing, a vLLM front-end option) is gone: each
# test runs once. pytest.mark.asyncio -> pytest.mark.anyio.
pytestmark = pytest.mark.anyio


async def test_show_version(server: StructllmServer):
    response = requests.get(server.url_for("version"))
    response.raise_for_status()

    # structllm: vllm.version.__version__ -> structllm.__version__
    assert response.json() == {"version": structllm.__version__}


async def test_check_health(server: StructllmServer):
    response = requests.get(server.url_for("health"))

    assert response.status_code == HTTPStatus.OK


async def test_request_cancellation(server: StructllmServer):
    # clunky test: send an ungodly amount of load in with short timeouts
    # then ensure that it still responds quickly afterwards

    chat_input = [{"role": "user", "content": "Write a long story"}]
    # structllm: each client is closed (async with): warnings are errors here.
    async with server.get_async_client(timeout=0.5) as client:
        tasks = []
        # Request about 2 million tokens
        # structllm: tiny's context is 2048 (upstream: --max-model-len 10100
        # and 10000 tokens a request), so 2000 a request: 400,000 in all.
        for _ in range(200):
            task = asyncio.create_task(
                client.chat.completions.create(
                    messages=chat_input,
                    model=MODEL_NAME,
                    max_tokens=2000,
                    extra_body={"min_tokens": 2000},
                )
            )
            tasks.append(task)

        done, pending = await asyncio.wait(tasks, return_when=asyncio.ALL_COMPLETED)

    # Make sure all requests were sent to the server and timed out
    # (We don't want to hide other errors like 400s that would invalidate this
    # test)
    assert len(pending) == 0
    for d in done:
        with pytest.raises(openai.APITimeoutError):
            d.result()

    # If the server had not cancelled all the other requests, then it would not
    # be able to respond to this one within the timeout
    async with server.get_async_client(timeout=5) as client:
        response = await client.chat.completions.create(
            messages=chat_input, model=MODEL_NAME, max_tokens=10
        )

    assert len(response.choices) == 1


async def test_request_wrong_content_type(server: StructllmServer):
    chat_input = [{"role": "user", "content": "Write a long story"}]
    # structllm: the client is closed (async with); max_tokens 10000 ->
    # 1000, inside tiny's context (the test is about the header).
    async with server.get_async_client() as client:
        with pytest.raises(openai.APIStatusError):
            await client.chat.completions.create(
                messages=chat_input,
                model=MODEL_NAME,
                max_tokens=1000,
                extra_headers={"Content-Type": "application/x-www-form-urlencoded"},
            )
