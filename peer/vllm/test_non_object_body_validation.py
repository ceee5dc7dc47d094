# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/chat_completion/test_non_object_body_validation.py
# (commit bc7e79650aad4960a965c42e5e81c0a1aef04ca8). What changed and why:
# peer/vllm/NOTES.md.

"""Non-object JSON bodies must fail validation cleanly (4xx), not AttributeError (500).

mode=before validators that call data.get(...) without an isinstance(data, dict)
guard raise AttributeError for string/list/scalar bodies and surface as HTTP 500.
"""

import json

import httpx
import pytest

from peer.conftest import StructllmServer
from peer.vllm.conftest import MODEL_NAME


# structllm: upstream calls ChatCompletionRequest.model_validate(payload);
# these post the payload as the body of POST /v1/chat/completions and
# expect a 400 with OpenAI's error body.
@pytest.mark.parametrize(
    "payload",
    [
        "this is not valid json{{{",
        ["not", "an", "object"],
        42,
        None,
    ],
)
def test_chat_completion_request_rejects_non_object_body(
    server: StructllmServer, payload
):
    # structllm: the string is sent as the raw body (not valid JSON), the
    # others as JSON.
    content = payload if isinstance(payload, str) else json.dumps(payload)
    res = httpx.post(
        server.url_for("v1/chat/completions"),
        content=content.encode(),
        headers={"Content-Type": "application/json"},
    )
    assert res.status_code == 400
    assert "message" in res.json()["error"]


def test_chat_completion_request_cache_salt_still_validated_on_dict(
    server: StructllmServer,
):
    res = httpx.post(
        server.url_for("v1/chat/completions"),
        json={
            "model": MODEL_NAME,  # structllm: upstream "qwen" (any name there)
            "messages": [{"role": "user", "content": "hello"}],
            "cache_salt": "",
        },
    )
    # structllm: pydantic's ValidationError -> a 400 naming cache_salt
    assert res.status_code == 400
    assert "cache_salt" in res.text
