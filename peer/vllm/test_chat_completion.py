# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/chat_completion/test_chat_completion.py
# (commit 006587544afc3ab7c830aaafe60e49e0cb6aeeb0). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.

import openai  # use the official client for correctness check
import pytest

from peer.vllm.conftest import MODEL_NAME

# structllm: RemoteOpenAIServer("Qwen/Qwen2.5-1.5B-Instruct") and its module
# fixtures -> the shared ``structllm serve tiny`` and peer/vllm/conftest.py's
# ``client``. pytest.mark.asyncio -> pytest.mark.anyio.
pytestmark = pytest.mark.anyio

# structllm: the requests that upstream expects to be refused set no limit;
# should one be accepted, tiny would write to the end of the context
# (NOTES.md, "Lengths"), so they get max_completion_tokens=32.
LIMIT = 32


@pytest.mark.xfail(
    reason="not implemented: truncate_prompt_tokens and truncation_side are "
    "refused (400 naming them)",
    strict=True,
)
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_chat_completion_truncation_side_controls_prompt_truncation(
    client: openai.AsyncOpenAI, model_name: str
) -> None:
    messages = [
        {
            "role": "user",
            "content": "Summarize how prompt truncation works in one sentence.",
        }
    ]

    full_completion = await client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=1,
        temperature=0.0,
        extra_body={"return_token_ids": True},
    )
    full_token_ids = full_completion.prompt_token_ids
    assert full_token_ids is not None
    assert len(full_token_ids) > 4

    right_completion = await client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=1,
        temperature=0.0,
        extra_body={
            "return_token_ids": True,
            "truncate_prompt_tokens": 4,
            "truncation_side": "right",
        },
    )
    assert right_completion.prompt_token_ids == full_token_ids[:4]

    left_completion = await client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=1,
        temperature=0.0,
        extra_body={
            "return_token_ids": True,
            "truncate_prompt_tokens": 4,
            "truncation_side": "left",
        },
    )
    assert left_completion.prompt_token_ids == full_token_ids[-4:]


@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_invalid_json_schema(client: openai.AsyncOpenAI, model_name: str) -> None:
    invalid_json_schema = {
        "$defs": {
            "CarType": {
                "enum": ["sedan", "SUV", "Truck", "Coupe"],
                "title": "CarType",
                "type": "string",
            }
        },
        "properties": {
            "brand": {"title": "Brand", "type": "string"},
            "model": {"title": "Model", "type": "string"},
            "car_type": {"$ref": "#/$defs/CarType"},
            "foo": "bar",
        },
        "required": ["brand", "model", "car_type"],
        "title": "CarDescription",
        "type": "object",
    }
    prompt = (
        "Generate a JSON with the brand, model and car_type of"
        "the most iconic car from the 90's"
    )
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        await client.chat.completions.create(
            model=model_name,
            messages=[
                {
                    "role": "user",
                    "content": prompt,
                }
            ],
            extra_body={"structured_outputs": {"json": invalid_json_schema}},
            max_completion_tokens=LIMIT,  # structllm: see LIMIT
        )


@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_invalid_regex(client: openai.AsyncOpenAI, model_name: str):
    prompt = (
        "Generate an email address for Alan Turing, who works in Enigma."
        "End in .com and new line. Example result:"
        "alan.turing@enigma.com\n"
    )

    with pytest.raises((openai.BadRequestError, openai.APIError)):
        await client.chat.completions.create(
            model=model_name,
            messages=[
                {
                    "role": "user",
                    "content": prompt,
                }
            ],
            extra_body={"structured_outputs": {"regex": r"[.*"}, "stop": ["\n"]},
            max_completion_tokens=LIMIT,  # structllm: see LIMIT
        )


@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_invalid_grammar(client: openai.AsyncOpenAI, model_name: str):
    invalid_simplified_sql_grammar = """
        root ::= select_statementinvalidsyntax

        select_statement ::= "SELECT " column " from " table " where " condition

        column ::= "col_1 " | "col_2 "

        table ::= "table_1 " | "table_2 "

        condition ::= column "= " number

        number ::= "1 " | "2 "
    """

    prompt = (
        "Generate an SQL query to show the 'username' and 'email'"
        "from the 'users' table."
    )
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        await client.chat.completions.create(
            model=model_name,
            messages=[
                {
                    "role": "user",
                    "content": prompt,
                }
            ],
            extra_body={
                "structured_outputs": {"grammar": invalid_simplified_sql_grammar}
            },
            max_completion_tokens=LIMIT,  # structllm: see LIMIT
        )


@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_empty_grammar(client: openai.AsyncOpenAI, model_name: str) -> None:
    prompt = "Say hello"
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        await client.chat.completions.create(
            model=model_name,
            messages=[
                {
                    "role": "user",
                    "content": prompt,
                }
            ],
            extra_body={"structured_outputs": {"grammar": ""}},
            max_completion_tokens=LIMIT,  # structllm: see LIMIT
        )
