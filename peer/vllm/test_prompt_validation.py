# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/completion/test_prompt_validation.py
# (commit 7a24fbb332c9a7db49473e678e1d0b9dddf39e8d). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.
# structllm: test_empty_prompt, test_load_prompt_embeds and
# test_disable_prompt_embeds are about prompt_embeds (not applicable:
# docs/peer-suites.md); the file keeps the one test that applies.

import re

import openai
import pytest

from peer.conftest import StructllmServer

pytestmark = pytest.mark.anyio


async def test_out_of_vocab_token_ids():
    # structllm: RemoteOpenAIServer("gpt2") -> structllm serve tiny-random
    # (a server of this test's own, as upstream starts one).
    model_name = "tiny-random"
    # structllm: the client is closed too (async with): warnings are errors.
    with StructllmServer(model_name) as remote_server:
        async with remote_server.get_async_client() as client:
            # structllm: vLLM says "out of vocabulary", structllm "outside
            # the vocabulary [0, N)" with param "prompt" (a wording difference).
            with pytest.raises(
                openai.BadRequestError,
                match=re.compile(".*outside the vocabulary.*").pattern,
            ):
                await client.completions.create(
                    model=model_name, prompt=[999999], max_tokens=5, temperature=0.0
                )
