# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/models/test_models.py
# (commit 76a76927d5715d2193f5cff2016214d70df8c7d1). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.

import openai  # use the official client for correctness check
import pytest

from peer.vllm.conftest import MODEL_NAME

# structllm: RemoteOpenAIServer("Qwen/Qwen3-0.6B", [--enable-lora,
# --lora-modules qwen3-lora=..., ...]) -> the shared ``structllm serve tiny``;
# LoRA is not applicable: test_retrieve_lora_model and the LoRA half of
# test_check_models go (docs/peer-suites.md). pytest_asyncio fixtures ->
# peer/vllm/conftest.py; pytest.mark.asyncio -> pytest.mark.anyio.
pytestmark = pytest.mark.anyio


async def test_check_models(client: openai.AsyncOpenAI):
    models = await client.models.list()
    models = models.data
    served_model = models[0]
    assert served_model.id == MODEL_NAME
    assert served_model.root == MODEL_NAME
    # structllm: the LoRA cards (models[1:]) go


async def test_retrieve_base_model(client: openai.AsyncOpenAI):
    model = await client.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME
    assert model.root == MODEL_NAME


async def test_retrieve_unknown_model(client: openai.AsyncOpenAI):
    with pytest.raises(openai.NotFoundError) as exc_info:
        await client.models.retrieve("this-model-does-not-exist")
    assert "does not exist" in str(exc_info.value)
