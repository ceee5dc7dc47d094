# Written for structllm after vllm-project/vllm
# tests/entrypoints/pooling/embed/test_usage_policy.py
# (commit 07807420b2db2bf16241f057d85608a9d51f2f4f), Apache-2.0
# (peer/vllm/LICENSE): the same tests and checks. What changed and why:
# peer/vllm/NOTES.md.
#
# structllm: RemoteOpenAIServer("BAAI/bge-base-en-v1.5", [--runner pooling,
# ...]) -> the shared ``structllm serve tiny``.

import openai
import pytest

from peer.vllm.conftest import MODEL_NAME

pytestmark = pytest.mark.anyio


class TestUsagePolicyDefault:
    async def test_non_streaming(self, client: openai.AsyncOpenAI):
        """One input: usage counts its prompt, nothing generated."""
        out = await client.embeddings.create(
            model=MODEL_NAME, input="Hello world", encoding_format="float"
        )
        assert out.usage is not None
        assert out.usage.prompt_tokens > 0
        assert out.usage.completion_tokens == 0
        assert out.usage.total_tokens == out.usage.prompt_tokens

    async def test_non_streaming_batch(self, client: openai.AsyncOpenAI):
        """Several inputs: one usage for all of them."""
        out = await client.embeddings.create(
            model=MODEL_NAME, input=["Hello", "World"], encoding_format="float"
        )
        assert out.usage is not None
        assert out.usage.prompt_tokens > 0
        assert out.usage.completion_tokens == 0
        assert out.usage.total_tokens > 0
