# Written for structllm after vllm-project/vllm
# tests/entrypoints/pooling/embed/test_online_dimensions.py
# (commit 27437309f7d9b411bf938315906d4f81d1bff83e), Apache-2.0
# (peer/vllm/LICENSE): the same test and checks. What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.
#
# structllm: upstream runs test_matryoshka against two HF models, e5-small
# (not Matryoshka) and snowflake-arctic-embed-m-v1.5 (Matryoshka, 256). The
# first becomes the shared ``structllm serve tiny`` (no Matryoshka config
# either); the second needs a real Matryoshka model and is not applicable
# (docs/peer-suites.md: tests/test_embeddings.py checks truncation on a tiny
# checkpoint whose config.json declares matryoshka_dimensions). The
# comparison with sentence-transformers is parity/test_embeddings.py's.

import openai
import pytest

from peer.conftest import StructllmServer
from peer.vllm.conftest import MODEL_NAME

pytestmark = pytest.mark.anyio

input_texts = ["The chef prepared a delicious meal."]


async def test_matryoshka(server: StructllmServer):
    async with server.get_async_client() as client:

        async def request(dimensions):
            prompts = input_texts * 3
            out = await client.embeddings.create(
                model=MODEL_NAME,
                input=prompts,
                dimensions=dimensions,
                encoding_format="float",
            )
            assert out.model_dump()["id"] is not None
            assert len(out.data) == 3 and len(out.data[0].embedding) > 0
            assert out.usage.completion_tokens == 0
            assert out.usage.prompt_tokens > 0 and out.usage.total_tokens > 0
            if dimensions is not None:
                assert len(out.data[0].embedding) == dimensions

        # not a Matryoshka model: its own size only
        await request(None)
        for dimensions in (-1, 16):
            with pytest.raises(openai.BadRequestError):
                await request(dimensions)
