"""Ollama's API through the ``ollama`` client, on a real socket, both loops.

The server is the app on hypercorn in this process (as ``structllm serve``
runs it) over ``tiny-random``; the ``ollama`` package's ``AsyncClient``
talks to it, and its ``Client`` from a worker thread. Greedy answers are
checked against what ``/v1/completions`` and ``/v1/chat/completions`` give
for the same input, so the routes are checked for their text, not only
their shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.to_thread
import httpx
import ollama
import pytest

from tests.test_server_app import Exchange, open_server, open_socket_server

pytestmark = pytest.mark.anyio

MODEL = "tiny-random"
GREEDY = {"temperature": 0, "num_predict": 6}
HI = [{"role": "user", "content": "Say hi"}]


@pytest.fixture
async def url() -> AsyncIterator[str]:
    engine = {"max_model_len": 1024, "num_blocks": 128}  # room for tools
    async with open_server(engine=engine) as s, open_socket_server(s) as url:
        yield url


@pytest.fixture
async def client(url: str) -> AsyncIterator[ollama.AsyncClient]:
    async with ollama.AsyncClient(host=url, timeout=30) as client:
        yield client


async def openai_text(url: str, route: str, body: dict[str, Any]) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.post(route, json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


async def test_generate_raw_matches_completions(
    url: str, client: ollama.AsyncClient
) -> None:
    expected = await openai_text(
        url, "/v1/completions", {"prompt": "hi", "max_tokens": 6}
    )
    whole = await client.generate(MODEL, "hi", raw=True, options=GREEDY)
    assert whole.response == expected and whole.done and whole.done_reason == "length"
    assert whole.eval_count == 6 and whole.prompt_eval_count is not None
    assert (
        whole.context is not None and len(whole.context) == whole.prompt_eval_count + 6
    )
    assert whole.total_duration is not None and whole.total_duration > 0
    parts = [
        p
        async for p in await client.generate(
            MODEL, "hi", raw=True, options=GREEDY, stream=True
        )
    ]
    assert "".join(p.response or "" for p in parts) == expected
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].response == "" and parts[-1].eval_count == 6

    # the sync client, from a thread
    def sync() -> ollama.GenerateResponse:
        with ollama.Client(host=url, timeout=30) as client:
            return client.generate(f"{MODEL}:latest", "hi", raw=True, options=GREEDY)

    again = await anyio.to_thread.run_sync(sync)
    assert again.response == expected


async def test_generate_templated_and_chat_match_chat_completions(
    url: str, client: ollama.AsyncClient
) -> None:
    expected = await openai_text(
        url, "/v1/chat/completions", {"messages": HI, "max_tokens": 6}
    )
    generated = await client.generate(MODEL, "Say hi", options=GREEDY)
    assert generated.response == expected
    chat = await client.chat(MODEL, messages=HI, options=GREEDY)
    assert chat.message.role == "assistant" and chat.message.content == expected
    assert chat.done_reason == "length" and chat.eval_count == 6
    parts = [
        p
        async for p in await client.chat(
            MODEL, messages=HI, options=GREEDY, stream=True
        )
    ]
    assert "".join(p.message.content or "" for p in parts) == expected
    assert parts[-1].done and parts[-1].message.content == ""
    # a system message, and the context of the answer continues it
    with_system = await client.generate(
        MODEL, "Say hi", system="Be brief", options=GREEDY
    )
    system = [{"role": "system", "content": "Be brief"}, *HI]
    assert with_system.response == await openai_text(
        url, "/v1/chat/completions", {"messages": system, "max_tokens": 6}
    )
    context = list(with_system.context or [])
    more = await client.generate(
        MODEL, "again", raw=True, context=context, options=GREEDY
    )
    async with httpx.AsyncClient(base_url=url) as http:
        again = (await http.post("/tokenize", json={"content": "again"})).json()
    # the context goes on: "again" without a BOS in the middle
    assert more.prompt_eval_count == len(context) + len(again["tokens"])
    assert more.response == await openai_text(
        url, "/v1/completions", {"prompt": [context + again["tokens"]], "max_tokens": 6}
    )


async def test_logprobs_whole_and_streamed(
    url: str, client: ollama.AsyncClient
) -> None:
    """Each token's logprob and its best 3, as ``/v1/completions`` gives them."""
    expected = await openai_logprobs(url)
    whole = await client.generate(
        MODEL, "hi", raw=True, options=GREEDY, logprobs=True, top_logprobs=3
    )
    got = [(lp.token, lp.logprob) for lp in whole.logprobs or ()]
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert [v for _, v in got] == pytest.approx([v for _, v in expected])
    for lp in whole.logprobs or ():
        assert lp.top_logprobs is not None and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].token == lp.token  # greedy: the best
    parts = [
        p
        async for p in await client.chat(
            MODEL, messages=HI, options=GREEDY, logprobs=True, stream=True
        )
    ]
    streamed = [lp for p in parts for lp in p.logprobs or ()]
    assert len(streamed) == parts[-1].eval_count == 6
    assert all(lp.top_logprobs is None for lp in streamed)


async def openai_logprobs(url: str) -> list[tuple[str, float]]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "hi",
                "max_tokens": 6,
                "temperature": 0,
                "logprobs": 3,
            },
        )
    lp = r.json()["choices"][0]["logprobs"]
    return list(zip(lp["tokens"], lp["token_logprobs"], strict=True))


async def test_format_schema_and_json(url: str, client: ollama.AsyncClient) -> None:
    schema = {"enum": ["yes", "no"]}
    r = await client.chat(
        MODEL, messages=HI, format=schema, options={"num_predict": 10, "seed": 1}
    )
    assert json.loads(r.message.content or "") in ("yes", "no")
    r = await client.generate(
        MODEL, "hi", format="json", options={"num_predict": 200, "seed": 3}
    )
    if r.done_reason == "stop":  # a random model may not close it in time
        assert isinstance(json.loads(r.response or ""), dict)
    else:
        assert (r.response or "").startswith("{")
    with pytest.raises(ollama.ResponseError) as bad:
        await client.chat(MODEL, messages=HI, format={"type": "nonsense"})
    assert bad.value.status_code == 400 and "format" in bad.value.error


async def test_tools_reach_the_template_and_history_renders(
    url: str, client: ollama.AsyncClient
) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    plain = await client.chat(MODEL, messages=HI, options=GREEDY)
    tooled = await client.chat(MODEL, messages=HI, tools=[tool], options=GREEDY)
    assert tooled.prompt_eval_count is not None and plain.prompt_eval_count is not None
    assert tooled.prompt_eval_count > plain.prompt_eval_count
    history = [
        *HI,
        {
            "role": "assistant",
            "content": None,  # as some clients send it with calls
            "tool_calls": [
                {"function": {"name": "weather", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_name": "weather"},
    ]
    r = await client.chat(MODEL, messages=history, tools=[tool], options=GREEDY)
    assert r.done and r.prompt_eval_count is not None
    assert r.prompt_eval_count > tooled.prompt_eval_count


REFUSED: list[tuple[dict[str, Any], int, str]] = [
    ({"options": {"mirostat": 2}}, 400, "options.mirostat"),
    ({"options": {"typical_p": 0.5}}, 400, "options.typical_p"),
    ({"options": {"no_such_option": 1}}, 400, "options.no_such_option"),
    ({"options": {"temperature": "hot"}}, 400, "options.temperature"),
    ({"options": {"num_ctx": 4}}, 400, "options.num_ctx"),
    ({"options": {"num_ctx": 1 << 20}}, 400, "options.num_ctx"),
    ({"options": {"num_predict": 0}}, 400, "options.num_predict"),
    (
        {"options": {"repeat_penalty": 1.2, "repeat_last_n": 64}},
        400,
        "options.repeat_last_n",
    ),
    ({"think": True}, 400, "think"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (
        {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
        400,
        "messages[0].images",
    ),
    ({"keep_alive": [1]}, 400, "keep_alive: must be"),
    ({"model": "llama3"}, 404, "llama3"),
]


async def test_refused_by_name(url: str) -> None:
    """Refused with a 400 (404 for another model) whose error names the field."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for call, status, named in REFUSED:
            body = {"model": MODEL, "messages": HI, "stream": False, **call}
            r = await http.post("/api/chat", json=body)
            assert r.status_code == status, r.text
            assert named in r.json()["error"]


async def test_accepted_options_and_keep_alive(
    url: str, client: ollama.AsyncClient
) -> None:
    options = {
        **GREEDY,
        "num_thread": 2,
        "num_gpu": 0,
        "use_mmap": True,
        "seed": -1,
        "num_ctx": 256,
        "top_k": 0,
        "repeat_last_n": -1,
        "repeat_penalty": 1.0,
    }
    r = await client.chat(MODEL, messages=HI, options=options, keep_alive="5m")
    expected = await openai_text(
        url, "/v1/chat/completions", {"messages": HI, "max_tokens": 6}
    )
    assert r.message.content == expected
    loaded = await client.generate(MODEL, keep_alive=-1)
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


async def test_model_routes(url: str, client: ollama.AsyncClient) -> None:
    tags = await client.list()
    assert [m.model for m in tags.models] == [MODEL]
    assert tags.models[0].details is not None
    ps = await client.ps()
    assert ps.models[0].model == MODEL and ps.models[0].context_length == 1024
    show = await client.show(MODEL)
    assert show.template and "messages" in show.template
    assert show.capabilities is not None and "completion" in show.capabilities
    assert "embedding" in show.capabilities  # /api/embed serves it
    with pytest.raises(ollama.ResponseError) as missing:
        await client.show("other")
    assert missing.value.status_code == 404
    embed = await client.embed(MODEL, "x")  # tests/test_embeddings_api.py: more
    assert len(embed.embeddings) == 1 and embed.model == MODEL
    with pytest.raises(ollama.ResponseError) as pull:
        await client.pull(MODEL)
    assert pull.value.status_code == 400 and "pulls none" in pull.value.error
    async with httpx.AsyncClient(base_url=url) as http:
        version = (await http.get("/api/version")).json()
        up = await http.get("/")  # the check Ollama's clients make
        head = await http.head("/")
    assert isinstance(version["version"], str)
    assert up.status_code == head.status_code == 200


CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "weather"},
        "parameters": {
            "type": "object",
            "properties": {"city": {"const": "Oslo"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "parameters"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize("stream", [False, True])
async def test_calls_in_the_answer_are_tool_calls(
    client: ollama.AsyncClient, stream: bool
) -> None:
    """An answer that is a JSON call (held to one by ``format``) comes back as
    ``tool_calls`` with ``arguments`` an object, streamed or not."""
    kw: dict[str, Any] = {"tools": [WEATHER], "format": CALL_SCHEMA}
    options = {"num_predict": 100, "temperature": 0}
    if stream:
        parts = [
            p
            async for p in await client.chat(
                MODEL, messages=HI, options=options, stream=True, **kw
            )
        ]
        calls = [c for p in parts for c in p.message.tool_calls or ()]
        content = "".join(p.message.content or "" for p in parts)
        done = parts[-1]
    else:
        done = await client.chat(MODEL, messages=HI, options=options, **kw)
        calls = list(done.message.tool_calls or ())
        content = done.message.content or ""
    assert done.done_reason == "stop"
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo"})
    ]
    assert content.strip() == ""


async def test_drain_refuses_then_cuts_an_ndjson_stream() -> None:
    """A drain covers Ollama's routes: new requests get 503, a stream cut at
    the end of the grace period ends with an ``{"error": ...}`` line."""
    # held by its format to more tokens than num_predict, so it cannot end early
    endless = {"type": "array", "items": {"const": 1}, "minItems": 200}
    body = {
        "model": MODEL,
        "prompt": "x",
        "raw": True,
        "format": endless,
        "options": {"num_predict": 250},
    }
    async with open_server() as s:
        x = Exchange(json.dumps(body).encode())
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(x.run, s.app, "/api/generate")
                await x.first_chunk.wait()
                s.drain.start()
                r = await s.http.post("/api/chat", json={"model": MODEL})
                assert r.status_code == 503
                assert s.drain.active == 1
                s.drain.cut()
                await s.drain.wait_idle()
        lines = [json.loads(line) for line in x.text.splitlines()]
        assert lines[0]["done"] is False
        assert "shut down" in lines[-1]["error"]
        await s.wait_idle()
