"""Structured output and tool calling through the server, end to end.

The random-weight "tiny-random" model writes whatever the grammar leaves it, so a
valid answer proves the constraint reached the sampler. Requests go through
``httpx.ASGITransport`` in process and, with the real ``openai`` client
(its ``parse`` and ``stream`` helpers, in a worker thread), over a loopback
socket to hypercorn in this process, on both AnyIO backends. Bodies use
small schemas (enums, short strings, no extra properties) so a random model
finishes in a few dozen tokens; ``logit_bias`` on ``]`` (byte 93) ends a
``"required"`` call list after its first call.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import anyio
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from structllm.errors import InvalidRequestError
from structllm.server.chat.protocol import ChatRequest
from structllm.server.completions.protocol import CompletionRequest
from structllm.server.http.body import validate
from structllm.structured import StructuredOutputs
from tests.test_server_app import Server, events, open_server, open_socket_server

pytestmark = pytest.mark.anyio

ENGINE = {"max_model_len": 1024, "num_blocks": 256, "block_size": 16}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "maxLength": 4},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_PARAMETERS,
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "noop",
            "parameters": {
                "type": "object",
                "properties": {},
                "additionalProperties": False,
            },
            "strict": True,
        },
    },
]
WEATHER = {"type": "function", "function": {"name": "get_weather"}}
#: "]" as likely as the grammar allows: a call list ends after one call
END_LIST = {"93": 100}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with open_server(engine=ENGINE) as s:
        yield s


async def chat(s: Server, **body: Any) -> dict[str, Any]:
    r = await s.http.post("/v1/chat/completions", json={"messages": CHAT, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


async def chat_stream(s: Server, **body: Any) -> list[dict[str, Any]]:
    body = {"messages": CHAT, "stream": True, **body}
    r = await s.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = events(r.text)
    assert out[-1] == "[DONE]"
    return out[:-1]


def assemble(chunks: list[dict[str, Any]]) -> tuple[str | None, list[Any], Any]:
    """Content, calls and finish reason of choice 0, as a client adds them up."""
    content: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("content") is not None:
                content = (content or "") + delta["content"]
            for tc in delta.get("tool_calls", []):
                if "id" in tc:
                    assert tc["index"] not in calls, "one first delta per call"
                    assert tc["type"] == "function" and tc["function"]["name"]
                    calls[tc["index"]] = {"id": tc["id"], **tc["function"]}
                else:
                    assert set(tc) == {"index", "function"}
                    calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# -- the request models and the conversion (no engine) ------------------------------


def sampling(model: type[Any], **body: Any) -> Any:
    base = {"messages": CHAT} if model is ChatRequest else {"prompt": "x"}
    return validate(model, {**base, **body}).to_sampling_params(16)


@pytest.mark.parametrize("model", [ChatRequest, CompletionRequest])
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
         StructuredOutputs(json_object=True)),
        ({"response_format": {"type": "json_schema",
          "json_schema": {"name": "a", "schema": SCHEMA, "strict": False}}},
         StructuredOutputs(json=SCHEMA)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputs(json=SCHEMA)),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutputs(regex="a+")),
        ({"structured_outputs": {"choice": ["a", "b", "a"]}},
         StructuredOutputs(choice=["a", "b"])),
        ({"structured_outputs": {"grammar": 'start: "a"'}},
         StructuredOutputs(grammar='start: "a"')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputs(json_object=True)),
        ({"guided_json": SCHEMA}, StructuredOutputs(json=SCHEMA)),
        ({"guided_regex": "a+"}, StructuredOutputs(regex="a+")),
        ({"guided_choice": ["x"]}, StructuredOutputs(choice=["x"])),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputs(grammar='root ::= "a"')),
    ],
)  # fmt: skip
def test_each_output_field_becomes_the_constraint(
    model: type[Any], fields: dict[str, Any], expected: StructuredOutputs | None
) -> None:
    assert sampling(model, **fields).structured_outputs == expected


def test_forced_calls_become_schemas() -> None:
    named = sampling(ChatRequest, tools=TOOLS, tool_choice=WEATHER)
    assert named.structured_outputs == StructuredOutputs(json=WEATHER_PARAMETERS)
    for parallel in (True, False):
        p = sampling(
            ChatRequest,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
        )
        schema = p.structured_outputs.json_schema()
        jsonschema.validate([{"name": "noop", "parameters": {}}], schema)
        two = [{"name": "noop", "parameters": {}}] * 2
        if parallel:
            jsonschema.validate(two, schema)
        else:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(two, schema)
    for choice in ("auto", "none", None):
        body = (
            {"tools": TOOLS}
            if choice is None
            else {"tools": TOOLS, "tool_choice": choice}
        )
        assert sampling(ChatRequest, **body).structured_outputs is None
    # "auto" keeps an output format; the tools are still parsed
    p = sampling(ChatRequest, tools=TOOLS, response_format={"type": "json_object"})
    assert p.structured_outputs == StructuredOutputs(json_object=True)


def test_completions_take_the_tool_no_ops_only() -> None:
    validate(CompletionRequest, {"prompt": "x", "tools": [], "tool_choice": "none"})
    for name, value in (("tools", TOOLS), ("tool_choice", "auto"),
                        ("parallel_tool_calls", False)):  # fmt: skip
        with pytest.raises(InvalidRequestError) as e:
            validate(CompletionRequest, {"prompt": "x", name: value})
        assert e.value.field == name


# -- response_format and structured_outputs -------------------------------------------


async def test_response_format_json_object_and_json_schema(server: Server) -> None:
    out = await chat(
        server, max_tokens=64, seed=0, response_format={"type": "json_object"}
    )
    assert out["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict)
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
    }
    for seed in range(3):
        out = await chat(server, max_tokens=96, response_format=fmt, seed=seed)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    content, calls, finish = assemble(
        await chat_stream(server, max_tokens=96, response_format=fmt, seed=7)
    )
    assert finish == "stop" and not calls and content is not None
    jsonschema.validate(json.loads(content), SCHEMA)
    r = await server.http.post(
        "/v1/completions",
        json={"prompt": "JSON:", "max_tokens": 96, "response_format": fmt},
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"structured_outputs": {"regex": "[a-c]{2,5}-[0-9]"}}, r"[a-c]{2,5}-[0-9]"),
        ({"guided_regex": "(yes|no)!"}, r"(yes|no)!"),
        ({"structured_outputs": {"choice": ["red", "green"]}}, r"red|green"),
        ({"guided_choice": ["up", "down"]}, r"up|down"),
        ({"structured_outputs": {"grammar": 'start: "x" DIGIT DIGIT\n'
          "%import common.DIGIT"}}, r"x[0-9]{2}"),
        ({"guided_grammar": 'root ::= "a" ("b" | "c")'}, r"a[bc]"),  # GBNF
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, None),
        ({"guided_json": SCHEMA}, None),
    ],
)  # fmt: skip
async def test_structured_outputs_on_both_endpoints(
    server: Server, fields: dict[str, Any], check: str | None
) -> None:
    out = await chat(server, max_tokens=96, **fields)
    r = await server.http.post(
        "/v1/completions", json={"prompt": "Answer:", "max_tokens": 96, **fields}
    )
    assert r.status_code == 200, r.text
    texts = [out["choices"][0]["message"]["content"], r.json()["choices"][0]["text"]]
    assert out["choices"][0]["finish_reason"] == "stop"
    for text in texts:
        if check is None:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(check, text), text


# -- tools ---------------------------------------------------------------------------


async def test_required_and_named_tool_calls(server: Server) -> None:
    cases: list[dict[str, Any]] = [
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"tool_choice": "required", "logit_bias": END_LIST},
        {"tool_choice": WEATHER},
    ]
    for fields in cases:
        out = await chat(server, max_tokens=120, tools=TOOLS, **fields)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        message = choice["message"]
        assert message["content"] is None and len(message["tool_calls"]) == 1
        [tc] = message["tool_calls"]
        assert re.fullmatch(r"call_[0-9a-f]{24}", tc["id"]) and tc["type"] == "function"
        check_call(tc["function"]["name"], tc["function"]["arguments"])
        if fields["tool_choice"] == WEATHER:
            assert tc["function"]["name"] == "get_weather"
        content, calls, finish = assemble(
            await chat_stream(server, max_tokens=120, tools=TOOLS, **fields)
        )
        assert content is None and finish == "tool_calls" and len(calls) == 1
        check_call(calls[0]["name"], calls[0]["arguments"])


async def test_each_of_n_streamed_choices_has_its_own_calls(server: Server) -> None:
    chunks = await chat_stream(
        server, n=3, seed=1, max_tokens=120, tools=TOOLS, tool_choice=WEATHER
    )
    ids = set()
    for index in range(3):
        mine = [
            {**chunk, "choices": [c for c in chunk["choices"] if c["index"] == index]}
            for chunk in chunks
        ]
        content, calls, finish = assemble(mine)
        assert content is None and finish == "tool_calls" and len(calls) == 1
        assert calls[0]["name"] == "get_weather"
        check_call("get_weather", calls[0]["arguments"])
        ids.add(calls[0]["id"])
    assert len(ids) == 3


async def test_tools_and_tool_messages_reach_the_template(server: Server) -> None:
    messages = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "c"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
    ]
    for choice in ("auto", "none"):
        out = await chat(
            server,
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=4,
            return_token_ids=True,
        )
        prompt = server.llm.tokenizer.decode(out["prompt_token_ids"])
        assert (
            "<|tools|>" in prompt and '"description": "The weather in a city"' in prompt
        )
        assert (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"' in prompt
        )
        assert "<|tool|>\nsunny, 21" in prompt
        # random text is no call: content, as generated
        message = out["choices"][0]["message"]
        assert "tool_calls" not in message and isinstance(message["content"], str)


async def test_bad_specs_are_400s_naming_the_field_while_others_run(
    server: Server,
) -> None:
    bad_tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "x"}},
    }
    cases: list[tuple[dict[str, Any], str]] = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format.json_schema.name"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace_pattern": " "}},
         "structured_outputs.whitespace_pattern"),
        ({"guided_regex": "(", "structured_outputs": None}, "guided_regex"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs"),
        ({"tools": [TOOLS[0], bad_tool]}, "tools[1].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        ({"tools": TOOLS, "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools[0].function.name"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
          "function": {"name": "f", "arguments": "{oops"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
    ]  # fmt: skip
    long = {"prompt": "x", "max_tokens": 150, "ignore_eos": True}
    done: dict[str, Any] = {}

    async def run_long() -> None:
        r = await server.http.post("/v1/completions", json=long)
        done["long"] = r

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_long)
        await server.llm.wait_statistics(lambda st: st.running == 1)
        for fields, param in cases:
            body = {"messages": CHAT, "max_tokens": 8, **fields}
            r = await server.http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (fields, r.text)
            error = r.json()["error"]
            assert error["param"] == param, (fields, error)
            assert error["message"].startswith(f"{param}: "), error
        r = await server.http.post(
            "/v1/completions",
            json={"prompt": "x", "structured_outputs": {"regex": "(?=x)"}},
        )
        assert r.json()["error"]["param"] == "structured_outputs.regex"
        r = await server.http.post(
            "/v1/completions", json={"prompt": "x", "tools": TOOLS}
        )
        assert r.json()["error"]["param"] == "tools"
    response = done["long"]
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 150
    await server.wait_idle()


async def test_a_refusal_from_the_engine_core_names_the_request_field(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the checks at validation and admission (turned off here), the
    core's compiler refuses; the 400, or the stream's last event, still
    names the request's field, not ``structured_outputs.json``."""
    import structllm.server.protocol.constraints
    import structllm.structured.compiler

    def passes(constraint: object, **kw: object) -> None:
        return None

    monkeypatch.setattr(structllm.server.protocol.constraints, "validate", passes)
    monkeypatch.setattr(structllm.structured.compiler, "validate", passes)
    bad = {"type": "object", "properties": {"a": {"type": "wat"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": bad}}
    body = {"messages": CHAT, "max_tokens": 8, "response_format": fmt}
    r = await server.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"
    r = await server.http.post("/v1/chat/completions", json={**body, "stream": True})
    *_, last, done = events(r.text)
    assert done == "[DONE]" and last["error"]["param"] == (
        "response_format.json_schema.schema"
    )
    tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
    r = await server.http.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "tools": [tool], "tool_choice": "required"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    await server.wait_idle()


async def test_specs_compile_in_a_worker_thread_once(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    import structllm.server.protocol.constraints

    real = structllm.server.protocol.constraints.validate
    threads: list[int] = []

    def recording(constraint: Any, **kw: Any) -> None:
        threads.append(threading.get_ident())
        real(constraint, **kw)

    monkeypatch.setattr(structllm.server.protocol.constraints, "validate", recording)
    pattern = f"[0-9]{{3}}({uuid.uuid4().hex[:6]})?"  # new to the process
    for _ in range(2):
        out = await chat(server, max_tokens=16, structured_outputs={"regex": pattern})
        assert re.fullmatch(pattern, out["choices"][0]["message"]["content"])
    assert len(threads) == 1 and threads[0] != threading.get_ident()


async def test_openapi_describes_the_new_fields(server: Server) -> None:
    doc = (await server.http.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    props = schemas["ChatRequest"]["properties"]
    for name in ("tools", "tool_choice", "parallel_tool_calls", "response_format",
                 "structured_outputs", "guided_json"):  # fmt: skip
        assert name in props, name
    assert "response_format" in schemas["CompletionRequest"]["properties"]
    assert "tools" not in schemas["CompletionRequest"]["properties"]
    root = {"$ref": "#/components/schemas/ChatRequest", "components": doc["components"]}
    good = [
        {"messages": CHAT, "tools": TOOLS, "tool_choice": WEATHER},
        {"messages": CHAT, "tools": TOOLS, "tool_choice": "required"},
        {"messages": CHAT, "response_format": {"type": "json_schema",
         "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
        {"messages": CHAT, "structured_outputs": {"json": SCHEMA}},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "x"}]},
    ]  # fmt: skip
    for body in good:
        jsonschema.validate(body, root)
    for body in (
        {"messages": CHAT, "tool_choice": "sometimes"},
        {"messages": CHAT, "response_format": {"type": "yaml"}},
        {"messages": CHAT, "structured_outputs": {"pattern": "a"}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(body, root)
    chunk = schemas["ChatCompletionStreamResponse"]
    assert chunk is not None and "ToolCallDelta" in schemas and "ToolCall" in schemas


# -- the real openai client over a socket ----------------------------------------------
#
# The synchronous client, in a worker thread: the server runs on the test's
# loop (asyncio or trio), and the async client's stream helpers leave async
# generators for the garbage collector, which trio reports.


class Answer(BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]


@pytest.fixture
async def client(server: Server) -> AsyncIterator[openai.OpenAI]:
    async with open_socket_server(server) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        try:
            yield c
        finally:
            c.close()


def parse_answers(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "tiny-random", "messages": CHAT, "max_tokens": 64}
    completion = client.chat.completions.parse(response_format=Answer, **kw)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Answer) and completion.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(response_format=Answer, **kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Answer)


async def test_openai_client_parses_response_format(client: openai.OpenAI) -> None:
    await anyio.to_thread.run_sync(parse_answers, client)


def read_tool_calls(client: openai.OpenAI) -> None:
    for choice in ("required", WEATHER):
        kw: dict[str, Any] = {
            "model": "tiny-random",
            "messages": CHAT,
            "tools": TOOLS,
            "tool_choice": choice,
            "parallel_tool_calls": False,
            "max_tokens": 120,
        }
        c = client.chat.completions.create(**kw).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert c.message.tool_calls is not None
        call = c.message.tool_calls[0]
        assert call.type == "function"
        check_call(call.function.name, call.function.arguments)
        with client.chat.completions.stream(**kw) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
        c2 = final.choices[0]
        assert c2.finish_reason == "tool_calls" and c2.message.tool_calls
        call2 = c2.message.tool_calls[0]
        check_call(call2.function.name, call2.function.arguments)
        assert call2.function.parsed_arguments == json.loads(call2.function.arguments)
        if choice == WEATHER:
            assert call.function.name == call2.function.name == "get_weather"
        chunks = list(client.chat.completions.create(stream=True, **kw))
        deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
        assert deltas[0].id and deltas[0].function and deltas[0].function.name
        assert all(d.id is None for d in deltas[1:])


async def test_openai_client_reads_tool_calls(client: openai.OpenAI) -> None:
    await anyio.to_thread.run_sync(read_tool_calls, client)


def bad_schema(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny-random",
            messages=CHAT,  # type: ignore[arg-type]
            response_format={  # type: ignore[arg-type,typeddict-item]
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "nonsense"}},
            },
        )
    assert isinstance(e.value.body, dict)
    assert e.value.body["param"] == "response_format.json_schema.schema"
    ok = client.chat.completions.create(
        model="tiny-random",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=2,
    )
    assert ok.choices[0].message.content is not None


async def test_openai_client_gets_400_naming_the_field(client: openai.OpenAI) -> None:
    await anyio.to_thread.run_sync(bad_schema, client)
