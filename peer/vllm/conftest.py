# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm tests/entrypoints/conftest.py
# (commit d6bf50eeadbaafe2bd539d7eecd4cc8664e7c3cb) and the per-module
# ``server`` / ``client`` fixtures of tests/entrypoints/openai; see NOTES.md.
"""Fixtures of the vLLM suite: one shared ``structllm serve tiny``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from peer.conftest import MODEL, StructllmServer

#: The served model name every adapted test sends (vLLM: an HF repo id).
MODEL_NAME = MODEL


@pytest.fixture(scope="module")
def server(shared_server: StructllmServer) -> StructllmServer:
    return shared_server


@pytest.fixture
async def client(server: StructllmServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with server.get_async_client() as async_client:
        yield async_client


@pytest.fixture
def model_name() -> str:
    return MODEL_NAME


@pytest.fixture
def sample_regex() -> str:
    return (
        r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}"
        r"(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
    )


@pytest.fixture
def sample_json_schema() -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "skills": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "minItems": 3,
            },
            "work_history": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "company": {"type": "string"},
                        "duration": {"type": "number"},
                        "position": {"type": "string"},
                    },
                    "required": ["company", "position"],
                },
            },
        },
        "required": ["name", "age", "skills", "work_history"],
    }


@pytest.fixture
def sample_structured_outputs_choices() -> list[str]:
    return [
        "Python",
        "Java",
        "JavaScript",
        "C++",
        "C#",
        "PHP",
        "TypeScript",
        "Ruby",
        "Swift",
        "Kotlin",
    ]
