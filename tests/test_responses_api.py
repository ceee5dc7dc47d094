"""``POST /v1/responses``: in process on both loops, and with the real openai client.

A response is a chat completion underneath, so at temperature 0 its text
is what ``/v1/chat/completions`` writes for the same conversation: that is
how the conversion of ``input`` items, ``instructions``, tool loops and
``previous_response_id`` is checked on the random ``tiny-random`` model.
Tools and ``text.format`` are held by grammars, so their outputs validate
whatever the model's weights.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import anyio
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from structllm.errors import InvalidRequestError
from structllm.server.chat.protocol import ChatRequest
from structllm.server.http.body import validate
from structllm.server.responses.objects import ResponseObject
from structllm.server.responses.protocol import ResponsesRequest, responses_field
from structllm.server.responses.store import ResponseStore
from tests.test_server_app import (
    Exchange,
    Server,
    events,
    open_server,
    open_socket_server,
)

pytestmark = pytest.mark.anyio

ENGINE = {"max_model_len": 1024, "num_blocks": 256, "block_size": 16}
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "n"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with open_server(engine=ENGINE) as s:
        yield s


async def respond(s: Server, **body: Any) -> dict[str, Any]:
    body = {"temperature": 0, "max_output_tokens": 8, **body}
    r = await s.http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    ResponseObject.model_validate(r.json())  # the shape /openapi.json describes
    return dict(r.json())


async def respond_stream(s: Server, **body: Any) -> list[dict[str, Any]]:
    body = {"temperature": 0, "max_output_tokens": 8, "stream": True, **body}
    r = await s.http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    return events(r.text, named=True)  # event: its type, as OpenAI sends


async def chat_text(s: Server, messages: list[dict[str, Any]], **body: Any) -> str:
    body = {"messages": messages, "temperature": 0, "max_tokens": 8, **body}
    r = await s.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def check_sequence(stream: list[dict[str, Any]]) -> dict[str, Any]:
    """The SDK's event order; the completed response, which the deltas add up to."""
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    kinds = [e["type"] for e in stream]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    open_items: dict[int, dict[str, Any]] = {}
    texts: dict[str, str] = {}
    for e in stream[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert e["output_index"] not in open_items
            assert e["item"]["status"] == "in_progress"
            open_items[e["output_index"]] = e["item"]
            texts[e["item"]["id"]] = ""
        elif kind == "response.output_item.done":
            added = open_items.pop(e["output_index"])
            assert e["item"]["id"] == added["id"]
            assert e["item"]["status"] in ("completed", "incomplete")
        elif kind.endswith(".delta"):
            assert e["item_id"] in texts and e["output_index"] in open_items
            texts[e["item_id"]] += e["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert texts[e["item_id"]] == e["text"]
        elif kind == "response.function_call_arguments.done":
            assert texts[e["item_id"]] == e["arguments"]
        else:
            assert kind in ("response.content_part.added", "response.content_part.done")
    assert not open_items, "every item is closed"
    done = stream[-1]["response"]
    assert done["id"] == stream[0]["response"]["id"]
    for item in done["output"]:
        text = "".join(c["text"] for c in item.get("content") or [])
        assert texts[item["id"]] == (item.get("arguments") or text)
    return dict(done)


# -- the request model (no engine) ---------------------------------------------------


def test_input_items_become_chat_messages() -> None:
    req = validate(
        ResponsesRequest,
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "Weather in "},
                    {"type": "input_text", "text": "Paris?"},
                ]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "get_weather",
                 "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
        },
    )  # fmt: skip
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert req.chat_body([{"role": "user", "content": "before"}])["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "before"},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "p"}}, "prompt"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
        ({"temperature": 2.5}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.name"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                     "arguments": "[1]"}]}, "input[0].arguments"),
    ],
)  # fmt: skip
def test_refused_and_invalid_fields_are_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        validate(ResponsesRequest, {"input": "x", **body})
    assert e.value.field == param


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
ITEM_KEYS = ["type", "role", "content", "call_id", "name", "arguments", "output"]
ITEMS = st.lists(
    st.dictionaries(
        st.sampled_from(ITEM_KEYS),
        JSON
        | st.sampled_from(
            ["message", "function_call", "function_call_output", "user", "{}"]
        ),
        max_size=5,
    ),
    max_size=3,
)


@settings(max_examples=100, deadline=None)
@given(
    field=st.sampled_from(
        [*ResponsesRequest.model_fields, "background", "include", "truncation"]
    ),
    value=JSON,
    items=ITEMS,
)
def test_any_json_is_a_request_or_a_refusal_naming_a_field(
    field: str, value: Any, items: list[dict[str, Any]]
) -> None:
    """Whatever a field holds, the request and its chat request validate, or
    one of them is refused naming a field the client sent."""
    for body in ({"input": "x", field: value}, {"input": items}):
        try:
            req = validate(ResponsesRequest, body)
            try:
                validate(ChatRequest, req.chat_body([]))
            except InvalidRequestError as exc:
                raise responses_field(exc) from None
        except InvalidRequestError as exc:
            assert exc.field, str(exc)
            root = exc.field.split(".")[0].split("[")[0]
            assert root in body, (exc.field, body)


def _kept(store: ResponseStore, rid: str, text: str) -> bool:
    return store.put({"id": rid}, [{"role": "user", "content": text}])


def test_the_store_is_bounded_and_names_unknown_ids() -> None:
    store = ResponseStore(capacity=2)
    for i in range(3):
        assert _kept(store, f"r{i}", str(i))
    assert len(store) == 2
    assert store.conversation("r2") == [{"role": "user", "content": "2"}]
    with pytest.raises(InvalidRequestError) as e:
        store.conversation("r0")
    assert e.value.field == "previous_response_id"
    # by size too, least recently used first; one too large alone is not kept
    store = ResponseStore(max_chars=200)
    assert _kept(store, "a", "x" * 50) and _kept(store, "b", "y" * 50)
    assert store.get("a") is not None  # a is used: b is older now
    assert _kept(store, "c", "z" * 50)
    assert store.get("b") is None and store.get("a") and store.get("c")
    assert not _kept(store, "d", "w" * 300) and store.get("d") is None
    assert store.delete("a") and not store.delete("a") and len(store) == 1


# -- through the app, both loops --------------------------------------------------------


async def test_text_whole_and_streamed_is_what_chat_writes(server: Server) -> None:
    s = server
    body = {"instructions": "Answer.", "input": "Hello there", "metadata": {"k": "v"}}
    whole = await respond(s, **body)
    expected = await chat_text(
        s,
        [
            {"role": "system", "content": "Answer."},
            {"role": "user", "content": "Hello there"},
        ],
    )
    assert whole["id"].startswith("resp_") and whole["object"] == "response"
    assert whole["output"][0]["id"].startswith("msg_")
    assert output_text(whole) == expected
    assert whole["status"] == "incomplete"  # 8 tokens of a random model
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["metadata"] == {"k": "v"} and whole["instructions"] == "Answer."
    usage = whole["usage"]
    assert usage["output_tokens"] == 8
    assert usage["total_tokens"] == usage["input_tokens"] + 8
    done = check_sequence(await respond_stream(s, **body))
    assert output_text(done) == expected
    # the same counts (the prompt is served from the prefix cache now)
    assert done["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert {k: done["usage"][k] for k in ("input_tokens", "output_tokens")} == {
        "input_tokens": usage["input_tokens"],
        "output_tokens": 8,
    }


async def test_bad_requests_are_400_naming_the_field(server: Server) -> None:
    s = server
    for body, param in [
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        (
            {
                "input": "x",
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "a",
                        "schema": {"type": "nonsense"},
                    }
                },
            },
            "text.format.schema",
        ),
        (
            {"input": "x", "tools": [{**TOOL, "parameters": {"type": "nonsense"}}]},
            "tools[0].parameters",
        ),
        ({"input": "x", "tool_choice": FORCED}, "tool_choice"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ]:
        r = await s.http.post("/v1/responses", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)


async def test_previous_response_id_continues_the_conversation(server: Server) -> None:
    s = server
    first = await respond(s, input="Hi", store=True)
    second = await respond(s, input="And?", previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"]
    expected = await chat_text(
        s,
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": output_text(first)},
            {"role": "user", "content": "And?"},
        ],
    )
    assert output_text(second) == expected
    # not stored: it cannot be continued, nor read
    r = await s.http.post(
        "/v1/responses", json={"input": "x", "previous_response_id": second["id"]}
    )
    assert r.status_code == 400
    assert (await s.http.get(f"/v1/responses/{second['id']}")).status_code == 404
    # a stored one is read back as it was sent, streamed or not, and forgotten
    assert (await s.http.get(f"/v1/responses/{first['id']}")).json() == first
    done = check_sequence(await respond_stream(s, input="Hi", store=True))
    assert (await s.http.get(f"/v1/responses/{done['id']}")).json() == done
    r = await s.http.delete(f"/v1/responses/{first['id']}")
    assert r.json() == {"id": first["id"], "object": "response", "deleted": True}
    r = await s.http.delete(f"/v1/responses/{first['id']}")
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


async def test_a_tool_loop(server: Server) -> None:
    """A forced call, then its output sent back: the next answer is what chat
    writes after the same assistant call and tool message."""
    s = server
    whole = await respond(
        s, input="Weather?", tools=[TOOL], tool_choice=FORCED, max_output_tokens=40
    )
    call = whole["output"][0]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["status"] == "completed" and whole["status"] == "completed"
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    jsonschema.validate(json.loads(call["arguments"]), TOOL["parameters"])
    done = check_sequence(
        await respond_stream(
            s, input="Weather?", tools=[TOOL], tool_choice=FORCED, max_output_tokens=40
        )
    )
    assert done["output"][0]["arguments"] == call["arguments"]
    loop = [
        {"role": "user", "content": "Weather?"},
        {k: call[k] for k in ("type", "call_id", "name", "arguments")},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sun"},
    ]
    # "required": a list of calls, one at most without parallel_tool_calls
    required = await respond(
        s,
        input="Weather?",
        tools=[TOOL, {**TOOL, "name": "other"}],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
    )
    assert [i["type"] for i in required["output"]] == ["function_call"]
    assert required["output"][0]["name"] in ("get_weather", "other")
    assert required["tool_choice"] == "required"
    answer = await respond(s, input=loop, tools=[TOOL])
    expected = await chat_text(
        s,
        [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["call_id"],
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": call["arguments"],
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call["call_id"], "content": "sun"},
        ],
        tools=[
            {"type": "function", "function": {k: TOOL[k] for k in TOOL if k != "type"}}
        ],
    )
    assert output_text(answer) == expected


async def test_json_schema_text_format(server: Server) -> None:
    s = server
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    whole = await respond(
        s, input="JSON please", text={"format": fmt}, max_output_tokens=60
    )
    jsonschema.validate(json.loads(output_text(whole)), SCHEMA)
    assert whole["status"] == "completed" and whole["incomplete_details"] is None
    assert whole["text"]["format"]["schema"] == SCHEMA
    done = check_sequence(
        await respond_stream(
            s, input="JSON please", text={"format": fmt}, max_output_tokens=60
        )
    )
    jsonschema.validate(json.loads(output_text(done)), SCHEMA)


async def test_reasoning_items() -> None:
    """deepseek_r1 starts in the thinking: a random model never closes it,
    so its whole output is one reasoning item (as chat's reasoning_content)."""
    async with open_server(engine=ENGINE, reasoning_parser="deepseek_r1") as s:
        whole = await respond(s, input="Think", max_output_tokens=10)
        item = whole["output"][0]
        assert [i["type"] for i in whole["output"]] == ["reasoning"]
        assert item["id"].startswith("rs_") and item["summary"] == []
        r = await s.http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Think"}],
                "temperature": 0,
                "max_tokens": 10,
            },
        )
        thought = r.json()["choices"][0]["message"]["reasoning_content"]
        assert item["content"] == [{"type": "reasoning_text", "text": thought}]
        assert 0 < whole["usage"]["output_tokens_details"]["reasoning_tokens"] <= 10
        stream = await respond_stream(s, input="Think", max_output_tokens=10)
        done = check_sequence(stream)
        assert done["output"] == [
            {**item, "id": done["output"][0]["id"], "status": "incomplete"}
        ]
        assert any(e["type"] == "response.reasoning_text.delta" for e in stream)


# -- the real openai client over a socket ----------------------------------------------


class Answer(BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]


def use_the_sdk(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "tiny-random", "temperature": 0}
    res = client.responses.create(
        input=[
            {"role": "system", "content": "Book"},
            {"role": "user", "content": "Hi"},
        ],
        max_output_tokens=8,
        **kw,
    )
    assert res.id.startswith("resp_") and res.output[0].type == "message"
    assert res.output_text and res.usage is not None
    gathered = ""
    completed = None
    for event in client.responses.create(
        input="Hi", max_output_tokens=8, stream=True, **kw
    ):
        if event.type == "response.output_text.delta":
            gathered += event.delta
        if event.type == "response.completed":
            completed = event.response
    assert completed is not None and completed.output_text == gathered
    with client.responses.stream(input="Hi", max_output_tokens=8, **kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == gathered
    # a function tool
    call = client.responses.create(
        input="Weather?",
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        **kw,
    ).output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    # a json_schema format, parsed by the SDK
    parsed = client.responses.parse(
        input="JSON", text_format=Answer, max_output_tokens=60, **kw
    )
    assert isinstance(parsed.output_parsed, Answer)
    stored = client.responses.create(input="Hi", max_output_tokens=4, store=True, **kw)
    assert client.responses.retrieve(stored.id).output_text == stored.output_text
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input="x", truncation="auto", **kw)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "truncation"


async def test_the_openai_client(server: Server) -> None:
    async with open_socket_server(server) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        try:
            await anyio.to_thread.run_sync(use_the_sdk, client)
        finally:
            client.close()


# -- cancellation and failures ------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_leaves_aborts_the_request(stream: bool) -> None:
    body = {"input": "x", "max_output_tokens": 300, "temperature": 0, "stream": stream}
    async with open_server(engine=ENGINE) as s:
        x = Exchange(json.dumps(body).encode())
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(x.run, s.app, "/v1/responses")
                await s.llm.wait_statistics(lambda st: st.running == 1)
                x.hang_up.set()
        await s.wait_idle()
        assert await s.metric('structllm_requests_total{finished_reason="abort"}') == 1
        if stream:
            assert "response.completed" not in x.text
        else:
            assert x.sent[0]["status"] == 499
        assert (await respond(s, input="ok", max_output_tokens=2))["output"]


async def test_a_timeout_after_the_200_is_an_error_event() -> None:
    # at temperature 0 this prompt runs 2,000 tokens without an end (8 s here)
    body = {"input": "x", "max_output_tokens": 2000, "temperature": 0}
    engine = {**ENGINE, "max_model_len": 2048}
    async with open_server(engine=engine, request_timeout=0.2) as s:
        r = await s.http.post("/v1/responses", json={**body, "stream": True})
        stream = events(r.text, named=True)
        assert [e["type"] for e in stream[:2]] == [
            "response.created",
            "response.in_progress",
        ]
        assert stream[-1]["type"] == "error" and stream[-1]["code"] == "408"
        assert stream[-1]["sequence_number"] == len(stream) - 1
        await s.wait_idle()


async def test_openapi_describes_the_route() -> None:
    async with open_server(load=False) as s:
        doc = (await s.http.get("/openapi.json")).json()
    post = doc["paths"]["/v1/responses"]["post"]
    content = post["responses"]["200"]["content"]
    assert content["text/event-stream"]["schema"]["$ref"].endswith(
        "/ResponseStreamEvent"
    )
    ref = {"$ref": "#/components/schemas/ResponsesRequest"}
    root = {**ref, "components": doc["components"]}
    for body in (
        {"input": "x", "tools": [TOOL], "tool_choice": FORCED},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]},
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                           "schema": SCHEMA}}},
    ):  # fmt: skip
        jsonschema.validate(body, root)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"input": "x", "tool_choice": "sometimes"}, root)
    # the room's models do not replace chat's of the same kind
    chat = {"$ref": "#/components/schemas/ChatRequest", "components": doc["components"]}
    named = {"type": "function", "function": {"name": "f"}}
    body = {"messages": [{"role": "user", "content": "x"}], "tool_choice": named}
    jsonschema.validate(body, chat)
