# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/chat_completion/test_delta_tool_call_serialization.py
# (commit 05ccc282d97534547c629629516cc247a6519fe8). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.
# structllm: upstream serialises vLLM's DeltaMessage / DeltaToolCall objects
# made by hand; this streams a forced call from ``structllm serve`` and
# checks the same claims on the deltas that come over the wire.
# test_dist_cleanup_empty_cache_resilience (torch's accelerator cache in
# vLLM's distributed cleanup) is not applicable.

import json

import httpx

from peer.conftest import StructllmServer
from peer.vllm.conftest import MODEL_NAME

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "maxLength": 12}},
            "required": ["location"],
            "additionalProperties": False,
        },
    },
}


def _tool_call_deltas(server: StructllmServer) -> list[dict]:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "The weather in Tokyo?"}],
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_completion_tokens": 64,
        "seed": 0,
        "stream": True,
    }
    deltas = []
    url = server.url_for("v1/chat/completions")
    with httpx.stream("POST", url, json=body, timeout=60) as res:
        assert res.status_code == 200
        for line in res.iter_lines():
            data = line.removeprefix("data: ").strip()
            if not data or data == "[DONE]":
                continue
            for choice in json.loads(data)["choices"]:
                deltas += choice["delta"].get("tool_calls") or []
    return deltas


def test_delta_tool_call_serialization_omit_null(server: StructllmServer):
    """Verify that null fields in DeltaToolCall and DeltaFunctionCall are omitted

    when serialized to JSON, maintaining OpenAI streaming spec compatibility.
    """
    deltas = _tool_call_deltas(server)
    # structllm: the call is split over several chunks (upstream: two made
    # by hand)
    assert len(deltas) > 1

    # First chunk: includes id, type, index, and initial function call
    first = deltas[0]
    assert first["id"].startswith("call_")
    assert first["type"] == "function"
    assert first["index"] == 0
    # structllm: upstream's first delta has arguments ""; structllm's may
    # already carry the first characters of the arguments
    assert first["function"]["name"] == "get_weather"
    assert isinstance(first["function"]["arguments"], str)

    # Subsequent chunk: id and type are None (should be omitted, not null)
    for later in deltas[1:]:
        # id and type must not be in the serialized delta dictionary
        assert "id" not in later
        assert "type" not in later
        assert later["index"] == 0
        assert "name" not in later["function"]
        assert isinstance(later["function"]["arguments"], str)

    # structllm: the pieces make the call's arguments
    arguments = json.loads("".join(d["function"]["arguments"] for d in deltas))
    assert set(arguments) == {"location"}
