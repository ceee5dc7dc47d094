# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/completion/test_completion_text_offset.py
# (commit c3b0b516413eea08ed2cc7f6f5d003dbf5a50d1d). What changed and why:
# peer/vllm/NOTES.md.
# structllm: upstream feeds hand-made RequestOutputs (tokens "abc", " de",
# "!", the text held back by a stop string) to vLLM's serving class; this
# asks structllm serve for the same request (logprobs=0, stop=["\n\n"]) on
# tiny, greedy, streamed and not, and compares the text offsets.

import httpx

from peer.conftest import StructllmServer
from peer.vllm.conftest import MODEL_NAME


def _request(stream: bool) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": "Hi",
        "max_tokens": 8,
        "logprobs": 0,
        "stop": ["\n\n"],
        "stream": stream,
        "temperature": 0,
    }


def test_stream_text_offset_matches_non_stream_with_stop_holdback(
    server: StructllmServer,
):
    url = server.url_for("v1/completions")
    stream_offsets = []
    stream_text = ""
    with httpx.stream("POST", url, json=_request(stream=True), timeout=60) as res:
        for line in res.iter_lines():
            data = line.removeprefix("data: ").strip()
            if not data or data == "[DONE]":
                continue
            for choice in httpx.Response(200, content=data).json()["choices"]:
                stream_text += choice.get("text", "")
                if choice.get("logprobs"):
                    stream_offsets += choice["logprobs"]["text_offset"]

    response = httpx.post(url, json=_request(stream=False), timeout=60).json()
    logprobs = response["choices"][0]["logprobs"]
    assert logprobs is not None
    # structllm: upstream's expected [0, 3, 6] are for its three hand-made
    # tokens; tiny's offsets are each token's start in the text.
    tokens = logprobs["tokens"]
    starts = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert logprobs["text_offset"] == starts
    assert stream_offsets == logprobs["text_offset"]
    assert stream_text == response["choices"][0]["text"]
