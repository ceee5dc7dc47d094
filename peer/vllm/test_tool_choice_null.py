# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/chat_completion/test_tool_choice_null.py
# (commit 689fb8326cc24cc1a65d1eb72f789e124a3c35b7). What changed and why:
# peer/vllm/NOTES.md.
# structllm: upstream validates vLLM's ChatCompletionRequest and reads its
# tool_choice; these post the same bodies to structllm serve and compare
# what a client sees: the status, and the greedy answer (the same answer
# means the same tool_choice was applied).

"""An explicit `"tool_choice": null` has to mean the same as an absent key.

Clients that serialise their unset optional fields still send the key, and the
OpenAI API treats a null the same as an omission: `auto` when tools are present.
Left as a None it matches no branch downstream, so tool calls are never parsed
and a structured-outputs request is rejected as if it had asked for tools.
"""

import httpx
import pytest

from peer.conftest import StructllmServer
from peer.vllm.conftest import MODEL_NAME

MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


def _post(server: StructllmServer, body: dict) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(server.url_for("v1/chat/completions"), json=body, timeout=60)


def _message(res: httpx.Response) -> dict:
    assert res.status_code == 200, res.text
    return res.json()["choices"][0]["message"]


def test_null_tool_choice_defaults_to_auto_like_an_absent_one(server):
    omitted = _post(server, {"messages": MESSAGES, "tools": TOOLS})
    explicit_null = _post(
        server, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": None}
    )
    auto = _post(server, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"})

    assert _message(omitted) == _message(auto)
    assert _message(explicit_null) == _message(omitted)


def test_null_tool_choice_without_tools_matches_an_absent_one(server):
    omitted = _post(server, {"messages": MESSAGES})
    explicit_null = _post(server, {"messages": MESSAGES, "tool_choice": None})

    assert _message(explicit_null) == _message(omitted)


def test_null_tool_choice_does_not_conflict_with_structured_outputs(server):
    """The conflict check reads `tool_choice`, so a null was taken for a tool
    request and the caller was told it had asked for both."""
    res = _post(
        server,
        {
            "messages": MESSAGES,
            "structured_outputs": {"json": {"type": "object"}},
            "tool_choice": None,
        },
    )

    assert res.status_code == 200, res.text


@pytest.mark.parametrize(
    "tool_choice,tools",
    [
        ("bogus", TOOLS),
        ("auto", None),
    ],
)
def test_invalid_tool_choice_is_still_rejected(server, tool_choice, tools):
    payload = {"messages": MESSAGES, "tool_choice": tool_choice}
    if tools is not None:
        payload["tools"] = tools

    # structllm: ValidationError -> a 400 naming tool_choice
    res = _post(server, payload)
    assert res.status_code == 400
    assert res.json()["error"]["param"] == "tool_choice"


def test_explicit_none_tool_choice_is_untouched(server):
    none = _post(server, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"})

    # structllm: "none" parses no calls: the answer is text, whatever it says
    message = _message(none)
    assert not message.get("tool_calls")
    assert message["content"] is not None
