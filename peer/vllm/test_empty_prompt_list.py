# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/completion/test_empty_prompt_list.py
# (commit 22456d6eab88b3437ab6bb165c619eeb489023d0). What changed and why:
# peer/vllm/NOTES.md.
# structllm: upstream builds vLLM's CompletionRequest directly; these send
# the same prompts through the HTTP boundary to ``structllm serve``.

import httpx

from peer.conftest import StructllmServer
from peer.vllm.conftest import MODEL_NAME


def test_empty_prompt_list_rejected(server: StructllmServer):
    res = httpx.post(
        server.url_for("v1/completions"),
        json={"model": MODEL_NAME, "prompt": [], "max_tokens": 1},
    )
    assert res.status_code == 400
    assert res.json()["error"]["param"] == "prompt"


def test_nonempty_prompt_list_ok(server: StructllmServer):
    res = httpx.post(
        server.url_for("v1/completions"),
        json={"model": MODEL_NAME, "prompt": ["hello"], "max_tokens": 1},
    )
    assert res.status_code == 200
    assert len(res.json()["choices"]) == 1
