"""Schemathesis over the server's own OpenAPI document, with the API key.

Bodies generated from the request schemas of ``/v1/completions``,
``/v1/chat/completions``, ``/tokenize`` and ``/detokenize`` (schema-valid
ones, and schema-breaking ones) are posted to ``structllm serve`` over a
socket. Every answer must be: no 5xx; each 4xx an OpenAI error body whose
``code`` is the status; each 200 what the document says (status, content
type, body schema; streams checked event by event). After the batch a good
request still succeeds and the engine is idle.

Bounded for the suite: ``STRUCTLLM_FUZZ_EXAMPLES`` (default 50) schema-valid
examples per operation and half as many schema-breaking ones, on the loops
of ``STRUCTLLM_FUZZ_LOOPS`` (default ``asyncio``). ``nox -s fuzz`` runs 500
on both loops.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from pydantic import BaseModel
from schemathesis import Case
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from structllm.server.chat.protocol import (
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
)
from structllm.server.completions.protocol import (
    CompletionResponse,
    CompletionStreamResponse,
)
from structllm.server.protocol import bodies
from structllm.server.tokenize.protocol import DetokenizeResponse, TokenizeResponse
from tests.test_server_auth import serve

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("STRUCTLLM_FUZZ_EXAMPLES", "50"))
LOOPS = os.environ.get("STRUCTLLM_FUZZ_LOOPS", "asyncio").split(",")

#: operation -> (its 200 body model, its stream chunk model)
OPERATIONS: dict[str, tuple[type[BaseModel], type[BaseModel] | None]] = {
    "/v1/completions": (CompletionResponse, CompletionStreamResponse),
    "/v1/chat/completions": (
        ChatCompletionResponse,
        ChatCompletionStreamResponse,
    ),
    "/tokenize": (TokenizeResponse, None),
    "/detokenize": (DetokenizeResponse, None),
}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module", params=LOOPS)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    args = ["--api-key", KEY, "--request-timeout", "60", "--no-access-log"]
    args += ["--num-blocks", "256", "--max-num-seqs", "64"]
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    with serve(tmp, request.param, *args, env={}) as (url, _):
        yield url


def check(case: Case, r: httpx.Response, path: str) -> None:
    assert r.status_code < 500, (case.body, r.text)
    if r.status_code != 200:
        assert 400 <= r.status_code < 500
        assert r.headers["content-type"] == "application/json"
        body = bodies.ErrorResponse.model_validate(r.json())
        assert body.error.code == r.status_code, r.json()
        return
    model, chunk = OPERATIONS[path]
    if r.headers["content-type"].startswith("text/event-stream"):
        assert chunk is not None
        blocks = [b for b in r.text.split("\n\n") if b]
        assert blocks[-1] == "data: [DONE]", r.text[-500:]
        for block in blocks[:-1]:
            event = json.loads(block.removeprefix("data: "))
            if "error" in event:
                bodies.ErrorResponse.model_validate(event)
            else:
                chunk.model_validate(event)
    else:
        model.model_validate(r.json())


def send(http: httpx.Client, case: Case, url: str) -> httpx.Response:
    kw = case.as_transport_kwargs(base_url=url, headers=AUTH)
    if "data" in kw:  # raw bytes (schema-breaking bodies)
        kw["content"] = kw.pop("data")
    kw.pop("cookies", None)
    return http.request(**kw)


@pytest.mark.slow
@pytest.mark.parametrize("path", list(OPERATIONS))
def test_fuzz_never_5xx_and_errors_are_openai_shaped(server: str, path: str) -> None:
    doc = httpx.get(f"{server}/openapi.json").json()
    op = schemathesis.openapi.from_dict(doc)[path]["POST"]
    seen: dict[int, int] = {}
    with httpx.Client(timeout=120) as http:
        for mode, count in (
            (GenerationMode.POSITIVE, EXAMPLES),
            (GenerationMode.NEGATIVE, max(1, EXAMPLES // 2)),
        ):

            @settings(
                max_examples=count,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(mode))
            def run(case: Case) -> None:
                r = send(http, case, server)
                seen[r.status_code] = seen.get(r.status_code, 0) + 1
                check(case, r, path)
                streamed = r.headers["content-type"].startswith("text/event-stream")
                # schemathesis reads a text/event-stream schema as the schema
                # of the whole SSE event ({data, event, ...}, OpenAPI 3.2);
                # ours is the chunk in each data line, which check() validates
                case.validate_response(r, checks=CHECKS[:-1] if streamed else CHECKS)

            run()
        # the server still serves, and nothing is left running
        good: dict[str, Any] = {
            "/v1/completions": {"prompt": "hi", "max_tokens": 3},
            "/v1/chat/completions": {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
            "/tokenize": {"prompt": "hi"},
            "/detokenize": {"tokens": [104, 105]},
        }
        r = http.post(f"{server}{path}", json=good[path], headers=AUTH)
        assert r.status_code == 200, r.text
        OPERATIONS[path][0].model_validate(r.json())
        wait_idle(http, server)
    assert 200 in seen and any(400 <= s < 500 for s in seen), seen


def wait_idle(http: httpx.Client, url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = http.get(f"{url}/metrics").text
        values = {
            line.split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("structllm_num_requests")
            or line.startswith("structllm_kv_cache_usage_perc")
        }
        if not any(values.values()):
            return
        time.sleep(0.1)
    pytest.fail(f"the engine did not go idle: {values}")
