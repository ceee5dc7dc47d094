# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm after vllm-project/vllm
# tests/entrypoints/openai/responses/test_structured_output.py
# (commit 0985a564f4884e339ceda19b1b9667df77df6936): the same tests, written
# for structllm (here test_responses_structured_output.py). What changed and
# why: peer/vllm/NOTES.md; every change is marked "structllm:" below.
# structllm: TestConstraintToContentFormat (7 tests of a vLLM serving helper)
# is not applicable (docs/peer-suites.md). The event upstream's model
# extracts ("science fair", "Friday", Alice and Bob) is checked against the
# schema instead: tiny holds the schema, not the facts; and the strings and
# the list are bounded (tiny rambles inside an unbounded string).

import json
from typing import Annotated

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.anyio  # structllm: pytest.mark.asyncio -> anyio

EVENT_SCHEMA = {
    "type": "object",
    "properties": {
        "event_name": {"type": "string", "maxLength": 16},
        "date": {"type": "string", "maxLength": 16},
        "participants": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "maxItems": 3,
        },
    },
    "required": ["event_name", "date", "participants"],
    "additionalProperties": False,
}


async def test_structured_output(client: openai.AsyncOpenAI, model_name):
    response = await client.responses.create(
        model=model_name,
        input=[
            {"role": "system", "content": "Extract the event information."},
            {
                "role": "user",
                "content": "Alice and Bob are going to a science fair on Friday.",
            },
        ],
        text={
            "format": {
                "type": "json_schema",
                "name": "calendar_event",
                "schema": EVENT_SCHEMA,
                "description": "A calendar event.",
                "strict": True,
            }
        },
        max_output_tokens=400,  # structllm: room for tiny to close the object
    )
    # the schema holds the answer (the output text), not any reasoning
    event = json.loads(response.output[-1].content[0].text)
    jsonschema.validate(event, EVENT_SCHEMA)  # structllm: the facts -> the schema


async def test_structured_output_with_parse(client: openai.AsyncOpenAI, model_name):
    class CalendarEvent(BaseModel):
        # structllm: bounded, as above
        event_name: Annotated[str, Field(max_length=16)]
        date: Annotated[str, Field(max_length=16)]
        participants: Annotated[
            list[Annotated[str, Field(max_length=16)]], Field(max_length=3)
        ]

    response = await client.responses.parse(
        model=model_name,  # structllm: upstream None (vLLM serves any name)
        instructions="Extract the event information.",
        input="Alice and Bob are going to a science fair on Friday.",
        text_format=CalendarEvent,
        max_output_tokens=400,  # structllm: as above
    )
    # the output is parsed (structllm: its facts are not checked)
    assert isinstance(response.output_parsed, CalendarEvent)
