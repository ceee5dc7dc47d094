# SPDX-License-Identifier: Apache-2.0
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/chat_completion/test_logprob_token_ids_validation.py
# (commit 002032ee2b18e1f7bd924ec47b62504ba3866063). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.
# structllm: upstream validates vLLM's request models directly; these post
# the same bodies to ``structllm serve`` and expect a 400 naming the field
# (VLLMValidationError.parameter) where upstream expects a validation error;
# BatchChatCompletionRequest's rows post to /v1/chat/completions/batch, whose
# messages are a list of conversations. The bodies get max_tokens=1:
# structllm answers them today.

import httpx
import pytest

from peer.conftest import StructllmServer
from peer.vllm.conftest import MODEL_NAME

# structllm: logprob_token_ids is refused whatever its value (400 naming
# it: not implemented), so each of these refusals holds.

# structllm: the request classes -> their routes
MODELS = ["v1/chat/completions", "v1/chat/completions/batch", "v1/completions"]
BASE = {
    "v1/chat/completions": {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    },
    "v1/chat/completions/batch": {
        "model": MODEL_NAME,
        "messages": [[{"role": "user", "content": "hi"}]],
        "max_tokens": 1,
    },
    "v1/completions": {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1},
}


def _post(server: StructllmServer, route: str, data: dict) -> httpx.Response:
    return httpx.post(server.url_for(route), json=data, timeout=60)


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("logprobs", [None, False, True])
def test_rejects_empty_token_ids(server, cls, logprobs):
    data = {**BASE[cls], "logprob_token_ids": []}
    if logprobs is not None:
        # structllm: completions' logprobs is a count (vLLM's model takes the
        # bool there as well); False/True -> 0/1
        data["logprobs"] = logprobs if "chat" in cls else int(logprobs)
    res = _post(server, cls, data)
    assert res.status_code == 400
    assert res.json()["error"]["param"] == "logprob_token_ids"


@pytest.mark.parametrize("cls", MODELS)
def test_rejects_token_ids_without_logprobs(server, cls):
    res = _post(server, cls, {**BASE[cls], "logprob_token_ids": [100]})
    assert res.status_code == 400
    assert res.json()["error"]["param"] == "logprob_token_ids"


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("val", [123, "123"])
def test_defers_non_list_to_pydantic(server, cls, val):
    res = _post(server, cls, {**BASE[cls], "logprob_token_ids": val})
    assert res.status_code == 400
