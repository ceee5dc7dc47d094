# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/basic/test_chat_template.py
# (commit 41c914c8bc356f8f94c14bbd73694ed2c304c431). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.
# structllm: test_load_chat_template, test_no_load_chat_template_filelike and
# test_no_load_chat_template_literallike test vLLM's load_chat_template (its
# --chat-template flag): not applicable, structllm renders the model's own
# template and refuses a template in the request (docs/peer-suites.md).
# test_get_gen_prompt calls vLLM's apply_hf_chat_template with
# facebook/opt-125m (downloaded) and vLLM's examples/template_chatml.jinja;
# here the same messages go to ``structllm serve tiny``'s POST /tokenize
# (the ids chat completions would use), rendered with tiny's own ChatML
# template, and POST /detokenize spells them out.

import httpx
import pytest

from peer.conftest import StructllmServer
from peer.vllm.conftest import MODEL_NAME

# Define models, templates, and their corresponding expected outputs
MODEL_TEMPLATE_GENERATION_OUTPUT = [
    (
        True,
        False,
        """<|im_start|>user
Hello<|im_end|>
<|im_start|>assistant
Hi there!<|im_end|>
<|im_start|>user
What is the capital of<|im_end|>
<|im_start|>assistant
""",
    ),
    # structllm: vLLM's example template leaves the last message open when
    # there is no generation prompt; tiny's template (the model's) closes
    # every message, so the expected text ends with <|im_end|>\n.
    (
        False,
        False,
        """<|im_start|>user
Hello<|im_end|>
<|im_start|>assistant
Hi there!<|im_end|>
<|im_start|>user
What is the capital of<|im_end|>
""",
    ),
    pytest.param(
        False,
        True,
        """<|im_start|>user
Hello<|im_end|>
<|im_start|>assistant
Hi there!<|im_end|>
<|im_start|>user
What is the capital of<|im_end|>
<|im_start|>assistant
The capital of""",
    ),
]

TEST_MESSAGES = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there!"},
    {"role": "user", "content": "What is the capital of"},
]
ASSISTANT_MESSAGE_TO_CONTINUE = {"role": "assistant", "content": "The capital of"}


# structllm: the model and template parameters go (one served model, its
# own template)
@pytest.mark.parametrize(
    "add_generation_prompt,continue_final_message,expected_output",
    MODEL_TEMPLATE_GENERATION_OUTPUT,
)
def test_get_gen_prompt(
    server: StructllmServer,
    add_generation_prompt,
    continue_final_message,
    expected_output,
):
    # structllm: ChatCompletionRequest + apply_hf_chat_template -> the same
    # fields posted to /tokenize, and /detokenize for the text
    body = {
        "model": MODEL_NAME,
        "messages": [*TEST_MESSAGES, ASSISTANT_MESSAGE_TO_CONTINUE]
        if continue_final_message
        else TEST_MESSAGES,
        "add_generation_prompt": add_generation_prompt,
    }
    if continue_final_message:
        body["continue_final_message"] = continue_final_message
    res = httpx.post(server.url_for("tokenize"), json=body, timeout=60)
    assert res.status_code == 200, res.text
    res = httpx.post(
        server.url_for("detokenize"),
        json={"model": MODEL_NAME, "tokens": res.json()["tokens"]},
        timeout=60,
    )
    assert res.status_code == 200, res.text
    result = res.json()["prompt"]

    # Test assertion
    assert result == expected_output, (
        "The generated prompt does not match the expected output for "
        f"model {MODEL_NAME} and its template"
    )
