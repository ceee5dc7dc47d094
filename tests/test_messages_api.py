"""``POST /v1/messages`` (Anthropic's Messages API) and its token counter.

In process through ``httpx.ASGITransport`` for the shapes, the errors and
the keys, and behind a real loopback socket for the real ``anthropic``
client (its async client on both loops, its sync client from a worker
thread). Greedy answers are compared with what chat completions answers for
the same conversation, so the route is checked for what it generates, not
only for its shape.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import anthropic
import anyio
import anyio.to_thread
import httpx
import jsonschema
import pytest

from structllm.outputs import CompletionOutput
from structllm.server.app import build_app
from structllm.server.messages import protocol as messages_api
from structllm.server.messages import response as messages_response
from structllm.server.messages.protocol import MessagesRequest
from structllm.server.messages.serving import MessagesServing, parser_for
from structllm.server.messages.serving import _content as whole_content
from structllm.server.messages.streaming import MessageEvents
from structllm.server.protocol import bodies
from structllm.server.serving import EngineSlot, ServerConfig
from structllm.text.reasoning import ReasoningParser
from tests.test_server_app import Exchange, Server, open_server, open_socket_server

pytestmark = pytest.mark.anyio

#: this anthropic client has no temperature argument: sent as an extra field
GREEDY = {"temperature": 0}
#: room for the tools the template writes out
ENGINE = {"max_model_len": 1024, "num_blocks": 160}

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    },
}

#: a conversation with every kind of block, and the same one as chat messages
CONVERSATION: dict[str, Any] = {
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Looking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "Thanks",
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            ],
        },
    ],
    "tools": [WEATHER],
    "tool_choice": {"type": "none"},
}
CHAT_CONVERSATION: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "Thanks"},
    ],
    "tools": [CHAT_WEATHER],
    "tool_choice": "none",
}


async def chat_text(s: Server, body: dict[str, Any]) -> tuple[str, str]:
    """Chat's greedy answer and finish reason for ``body``."""
    r = await s.http.post("/v1/chat/completions", json={**body, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] or "", choice["finish_reason"]


def streamed(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The ``event:`` names and ``data:`` objects of an Anthropic stream."""
    out = []
    for block in text.split("\n\n"):
        if block:
            name, data = block.split("\n")
            assert name.startswith("event: ") and data.startswith("data: "), block
            obj = json.loads(data.removeprefix("data: "))
            assert obj["type"] == name.removeprefix("event: ")
            out.append((obj["type"], obj))
    return out


def check_sequence(got: list[tuple[str, dict[str, Any]]]) -> None:
    """Anthropic's order: start, ping, blocks (start, deltas, stop), delta, stop."""
    names = [n for n, _ in got]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    index = -1
    for name, e in got[2:-2]:
        if name == "content_block_start":
            index += 1
            assert e["index"] == index
        else:
            assert name in ("content_block_delta", "content_block_stop")
            assert e["index"] == index
    assert names.count("content_block_start") == names.count("content_block_stop")


# -- what is generated -------------------------------------------------------------


async def test_text_equals_chat_whole_and_streamed() -> None:
    async with open_server(engine=ENGINE) as s:
        body = {**CONVERSATION, "max_tokens": 8, "temperature": 0}
        text, finish = await chat_text(s, {**CHAT_CONVERSATION, "max_tokens": 8})
        r = await s.http.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        whole = messages_response.MessageResponse.model_validate(r.json())
        assert whole.id.startswith("msg_") and whole.type == "message"
        assert [b.type for b in whole.content] == ["text"]
        assert whole.content[0].text == text  # type: ignore[union-attr]
        assert (finish, whole.stop_reason) == ("length", "max_tokens")
        assert whole.usage.output_tokens == 8
        count = await s.http.post(
            "/v1/messages/count_tokens",
            json=CONVERSATION,
        )
        assert count.json() == {"input_tokens": whole.usage.input_tokens}

        r = await s.http.post("/v1/messages", json={**body, "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        got = streamed(r.text)
        check_sequence(got)
        deltas = [e["delta"] for n, e in got if n == "content_block_delta"]
        assert "".join(d["text"] for d in deltas) == text
        start, end = got[0][1], got[-2][1]
        assert start["message"]["usage"]["input_tokens"] == whole.usage.input_tokens
        assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert end["usage"] == {"output_tokens": 8}
        await s.wait_idle()


async def test_prefill_continues_the_final_assistant_message() -> None:
    async with open_server(engine=ENGINE) as s:
        convo = [
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        ]
        continued, _ = await chat_text(
            s,
            {
                "messages": [convo[0], {"role": "assistant", "content": "Hello"}],
                "max_tokens": 6,
                "continue_final_message": True,
            },
        )
        body = {"messages": convo, "max_tokens": 6, "temperature": 0}
        r = (await s.http.post("/v1/messages", json=body)).json()
        assert r["content"] == [{"type": "text", "text": continued}]
        # an empty final assistant message: a new turn, as without it
        fresh, _ = await chat_text(s, {"messages": convo[:1], "max_tokens": 6})
        empty = [convo[0], {"role": "assistant", "content": ""}]
        r = (await s.http.post("/v1/messages", json={**body, "messages": empty})).json()
        assert r["content"] == [{"type": "text", "text": fresh}]
        call = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
        final_call = [convo[0], {"role": "assistant", "content": [call]}]
        r = await s.http.post("/v1/messages", json={**body, "messages": final_call})
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("messages[1].content:")


async def test_stop_sequences() -> None:
    async with open_server(engine=ENGINE) as s:
        messages = [{"role": "user", "content": "Count to ten"}]
        text, _ = await chat_text(s, {"messages": messages, "max_tokens": 12})
        stop = text[3:5]
        assert len(stop) == 2
        expected, finish = await chat_text(
            s, {"messages": messages, "max_tokens": 12, "stop": [stop]}
        )
        assert finish == "stop" and expected == text[: text.find(stop)]
        body = {
            "messages": messages,
            "max_tokens": 12,
            "temperature": 0,
            "stop_sequences": [stop],
        }
        r = (await s.http.post("/v1/messages", json=body)).json()
        assert r["content"] == [{"type": "text", "text": expected}]
        assert (r["stop_reason"], r["stop_sequence"]) == ("stop_sequence", stop)
        got = streamed(
            (await s.http.post("/v1/messages", json={**body, "stream": True})).text
        )
        assert got[-2][1]["delta"] == {
            "stop_reason": "stop_sequence",
            "stop_sequence": stop,
        }


@pytest.mark.parametrize(
    "choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}]
)
async def test_forced_tool_use_whole_and_streamed(choice: dict[str, Any]) -> None:
    async with open_server(engine=ENGINE) as s:
        body = {
            "messages": [{"role": "user", "content": "Weather?"}],
            "max_tokens": 60,
            "temperature": 0,
            "tools": [WEATHER],
            "tool_choice": {**choice, "disable_parallel_tool_use": True},
        }
        r = await s.http.post("/v1/messages", json=body)
        whole = r.json()
        assert whole["stop_reason"] == "tool_use", whole
        (use,) = whole["content"]
        assert use["type"] == "tool_use" and use["id"].startswith("toolu_")
        assert use["name"] == "get_weather"
        jsonschema.validate(use["input"], WEATHER["input_schema"])

        got = streamed(
            (await s.http.post("/v1/messages", json={**body, "stream": True})).text
        )
        check_sequence(got)
        starts = [e["content_block"] for n, e in got if n == "content_block_start"]
        assert starts[-1]["type"] == "tool_use" and starts[-1]["input"] == {}
        assert starts[-1]["name"] == "get_weather"
        partial = "".join(
            e["delta"]["partial_json"]
            for n, e in got
            if n == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
        )
        assert json.loads(partial) == use["input"]  # greedy: the same call
        assert got[-2][1]["delta"]["stop_reason"] == "tool_use"
        await s.wait_idle()


def in_pieces(events: MessageEvents, out: CompletionOutput) -> list[dict[str, Any]]:
    """The events for ``out``'s text fed in pieces of three characters, in
    Anthropic's order (checked), dumped."""
    text, got = out.text, []
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    for i, piece in enumerate(pieces):
        got += events.feed(piece, i == len(pieces) - 1)
    got += events.finish(out, len(out.token_ids))
    dumped = [bodies.dump(e) for e in got]
    check_sequence(
        [("message_start", {}), ("ping", {})] + [(e["type"], e) for e in dumped]
    )
    return dumped


def test_auto_calls_in_text_whole_and_as_events() -> None:
    """A call the model writes under ``auto``: a text block, then a tool_use
    block, whole and from pieces of three characters."""
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    req = MessagesRequest.model_validate({**BASE, "tools": [WEATHER]})
    out = CompletionOutput(text=text, token_ids=(1, 2, 3), finish_reason="stop")
    blocks, called = whole_content(req, out, None)
    assert called and [b.type for b in blocks] == ["text", "tool_use"]
    assert blocks[0].text == "Let me look."  # type: ignore[union-attr]
    use = blocks[1]
    assert isinstance(use, messages_response.ToolUseBlock)
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})

    dumped = in_pieces(MessageEvents(parser_for(req)), out)
    starts = [e["content_block"] for e in dumped if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"]
    deltas = [e["delta"] for e in dumped if e["type"] == "content_block_delta"]
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == (
        "Let me look."
    )
    partial = "".join(
        d["partial_json"] for d in deltas if d["type"] == "input_json_delta"
    )
    assert json.loads(partial) == {"city": "Paris"}
    assert dumped[-2]["delta"]["stop_reason"] == "tool_use"
    assert dumped[-2]["usage"] == {"output_tokens": 3}


@pytest.mark.parametrize("auto", [False, True])
@pytest.mark.parametrize(
    "pieces", [["a ", " ", "b\n"], ["  ", "\n"], ["x", "", " y  "], ["<tool", " no"]]
)
def test_streamed_text_is_the_whole_text(pieces: list[str], auto: bool) -> None:
    """Whitespace held back is sent when text follows, and at the end."""
    req = MessagesRequest.model_validate({**BASE, "tools": [WEATHER]} if auto else BASE)
    events = MessageEvents(parser_for(req))
    got = []
    for i, piece in enumerate(pieces):
        got += events.feed(piece, i == len(pieces) - 1)
    out = CompletionOutput(text="".join(pieces), token_ids=(), finish_reason="stop")
    got += events.finish(out, 0)
    dumped = [bodies.dump(e) for e in got]
    text = "".join(
        e["delta"]["text"] for e in dumped if e["type"] == "content_block_delta"
    )
    assert text == out.text
    assert [b.text for b in whole_content(req, out, None)[0]] == [out.text]  # type: ignore[union-attr]
    assert sum(e["type"] == "content_block_start" for e in dumped) == 1


def test_thinking_then_a_call_whole_and_as_events() -> None:
    """With a reasoning parser: a thinking block (its signature empty, as
    llama.cpp's), then the answer's blocks; streamed in pieces of three
    characters, the same blocks, the thinking closed by a signature_delta."""
    text = (
        "Paris, I think.</think>\n\nLet me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    req = MessagesRequest.model_validate({**BASE, "tools": [WEATHER]})
    out = CompletionOutput(text=text, token_ids=(1, 2, 3), finish_reason="stop")
    blocks, called = whole_content(req, out, ReasoningParser("reasoning"))
    assert called and [b.type for b in blocks] == ["thinking", "text", "tool_use"]
    assert bodies.dump(blocks[0]) == {
        "type": "thinking",
        "thinking": "Paris, I think.",
        "signature": "",
    }
    events = MessageEvents(parser_for(req), ReasoningParser("reasoning"))
    dumped = in_pieces(events, out)
    starts = [e["content_block"] for e in dumped if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use"]
    assert starts[0] == {"type": "thinking", "thinking": "", "signature": ""}

    def joined(index: int, kind: str, key: str) -> str:
        return "".join(
            e["delta"][key]
            for e in dumped
            if e["type"] == "content_block_delta"
            and e["index"] == index
            and e["delta"]["type"] == kind
        )

    assert joined(0, "thinking_delta", "thinking") == "Paris, I think."
    assert joined(1, "text_delta", "text") == blocks[1].text  # type: ignore[union-attr]
    stop = dumped.index({"type": "content_block_stop", "index": 0})
    assert dumped[stop - 1]["delta"] == {"type": "signature_delta", "signature": ""}
    signed = [
        e
        for e in dumped
        if e["type"] == "content_block_delta" and "signature" in e["delta"]
    ]
    assert len(signed) == 1


async def test_thinking_needs_a_reasoning_parser() -> None:
    """deepseek_r1's output starts in the thinking, and a random model never
    closes it: the whole output is one thinking block (chat's
    reasoning_content), then an empty text block, whole and streamed."""
    enabled = {"type": "enabled", "budget_tokens": 8}
    body = {**BASE, "max_tokens": 10, "temperature": 0, "thinking": enabled}
    async with open_server(engine=ENGINE) as s:
        r = await s.http.post("/v1/messages", json=body)
        assert anthropic_error(r, 400) == "invalid_request_error"
        assert r.json()["error"]["message"].startswith("thinking: ")
        r = await s.http.post("/v1/messages", json={**body, "thinking": None})
        assert r.status_code == 200, r.text
    async with open_server(engine=ENGINE, reasoning_parser="deepseek_r1") as s:
        chat = await s.http.post(
            "/v1/chat/completions",
            json={"messages": BASE["messages"], "max_tokens": 10, "temperature": 0},
        )
        thought = chat.json()["choices"][0]["message"]["reasoning_content"]
        r = await s.http.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["content"] == [
            {"type": "thinking", "thinking": thought, "signature": ""},
            {"type": "text", "text": ""},
        ]
        r = await s.http.post("/v1/messages", json={**body, "stream": True})
        got = streamed(r.text)
        check_sequence(got)
        starts = [e["content_block"] for n, e in got if n == "content_block_start"]
        assert [b["type"] for b in starts] == ["thinking", "text"]
        deltas = [e["delta"] for n, e in got if n == "content_block_delta"]
        assert "".join(d.get("thinking", "") for d in deltas) == thought
        assert deltas[-1] == {"type": "signature_delta", "signature": ""}
        # Anthropic's rule: the budget is below max_tokens
        over = {**body, "thinking": {**enabled, "budget_tokens": 10}}
        r = await s.http.post("/v1/messages", json=over)
        assert anthropic_error(r, 400) == "invalid_request_error"
        assert r.json()["error"]["message"].startswith("thinking.budget_tokens:")
        # a replayed assistant message's thinking is left out of the prompt
        replay = [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "text", "text": "Hello"},
                ],
            },
            {"role": "user", "content": "again"},
        ]
        plain = [replay[0], {"role": "assistant", "content": "Hello"}, replay[2]]
        counts = [
            (
                await s.http.post("/v1/messages/count_tokens", json={"messages": m})
            ).json()["input_tokens"]
            for m in (replay, plain)
        ]
        assert counts[0] == counts[1]
        async with open_socket_server(s) as url:
            client = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
            async with client.messages.stream(
                model="tiny-random",
                max_tokens=10,
                thinking=enabled,  # type: ignore[arg-type]
                messages=BASE["messages"],
                extra_body=GREEDY,
            ) as stream:
                final = await stream.get_final_message()
            await client.close()
        assert final.content[0].type == "thinking"
        assert final.content[0].thinking == thought
        redacted = {"type": "redacted_thinking", "data": "x"}
        r = await s.http.post(
            "/v1/messages",
            json={
                **BASE,
                "messages": [
                    replay[0],
                    {"role": "assistant", "content": [redacted]},
                    replay[2],
                ],
            },
        )
        assert anthropic_error(r, 400) == "invalid_request_error"
        assert r.json()["error"]["message"].startswith("messages[1].content[0].type:")
        await s.wait_idle()


# -- what is refused -----------------------------------------------------------------


BASE: dict[str, Any] = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
}


#: (body, the field its 400 names)
BAD: list[tuple[dict[str, Any], str]] = [
    ({"messages": BASE["messages"]}, "max_tokens"),
    ({**BASE, "max_tokens": 0}, "max_tokens"),
    ({**BASE, "temperature": 1.5}, "temperature"),
    ({**BASE, "top_k": "5"}, "top_k"),
    ({**BASE, "stop_sequences": [""]}, "stop_sequences"),
    ({**BASE, "messages": []}, "messages"),
    ({**BASE, "logprobs": True}, "logprobs"),  # not Anthropic's
    ({**BASE, "n": 2}, "n"),
    # without a reasoning parser
    ({**BASE, "thinking": {"type": "enabled", "budget_tokens": 2}}, "thinking"),
    ({**BASE, "thinking": {"type": "adaptive"}}, "thinking"),
    ({**BASE, "mcp_servers": [{"type": "url"}]}, "mcp_servers"),
    ({**BASE, "service_tier": "priority"}, "service_tier"),
    (
        {
            **BASE,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "see"},
                        {"type": "image", "source": {"type": "base64"}},
                    ],
                }
            ],
        },
        "messages[0].content[1].type",
    ),
    (
        {**BASE, "messages": [{"role": "system", "content": "x"}]},
        "messages[0].role",
    ),
    (
        {
            **BASE,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_use", "id": "a", "name": "f", "input": {}}
                    ],
                }
            ],
        },
        "messages[0].content[0]",
    ),
    (
        {**BASE, "tools": [{"type": "web_search_20250305", "name": "w"}]},
        "tools[0].type",
    ),
    ({**BASE, "tools": [WEATHER, WEATHER]}, "tools[1].name"),
    (
        {**BASE, "tools": [{**WEATHER, "input_schema": {"type": "nope"}}]},
        "tools[0].input_schema",
    ),
    ({**BASE, "tool_choice": {"type": "any"}}, "tool_choice"),
    (
        {**BASE, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}},
        "tool_choice.name",
    ),
    ({**BASE, "tools": [WEATHER], "tool_choice": {"type": "some"}}, "tool_choice"),
    ({**BASE, "metadata": {"user_id": 5}}, "metadata.user_id"),
    ({**BASE, "system": [{"type": "image"}]}, "system[0].type"),
]


async def test_bad_fields_are_anthropic_400s_naming_them() -> None:
    async with open_server(engine=ENGINE) as s:
        for (body, field), route in itertools.product(
            BAD, ("/v1/messages", "/v1/messages/count_tokens")
        ):
            if route.endswith("count_tokens"):
                # the fields of the prompt, and every field not Anthropic's
                top = field.split(".")[0].split("[")[0]
                fields = messages_api.CountTokensRequest.model_fields
                if (
                    top not in fields
                    and top in messages_api.MessagesRequest.model_fields
                ):
                    continue
                body = {k: v for k, v in body.items() if k != "max_tokens"}
            r = await s.http.post(route, json=body)
            assert r.status_code == 400, (route, r.text)
            error = r.json()
            assert set(error) == {"type", "error"} and error["type"] == "error"
            assert error["error"]["type"] == "invalid_request_error"
            assert error["error"]["message"].startswith(f"{field}:"), error


async def test_other_errors_are_anthropic_shaped() -> None:
    async with open_server(engine=ENGINE) as s:
        r = await s.http.post("/v1/messages", json={**BASE, "model": "gpt-4"})
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"
        r = await s.http.post(
            "/v1/messages",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["type"] == "error"
        r = await s.http.post("/v1/messages", json={**BASE, "max_tokens": 10_000})
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("max_tokens:")
        # the accepted no-ops
        ok = {
            **BASE,
            "metadata": {"user_id": "u"},
            "thinking": {"type": "disabled"},
            "service_tier": "auto",
            "top_k": 5,
            "top_p": 0.5,
        }
        assert (await s.http.post("/v1/messages", json=ok)).status_code == 200


def anthropic_error(r: httpx.Response, status: int) -> str:
    """The type of an Anthropic error response with ``status``."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    return str(body["error"]["type"])


async def test_the_apps_own_errors_are_anthropic_shaped_on_its_routes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """404, 405, a bug's 500 and the concurrency limit's 503, not only the
    serving's errors, answer in Anthropic's shape on /v1/messages."""
    async with open_server(engine=ENGINE, max_concurrent_requests=1) as s:
        r = await s.http.get("/v1/messages")
        assert anthropic_error(r, 405) == "invalid_request_error"
        r = await s.http.post("/v1/messages/nope", json=BASE)
        assert anthropic_error(r, 404) == "not_found_error"
        r = await s.http.post("/v1/nope", json=BASE)  # elsewhere OpenAI's
        assert r.status_code == 404 and r.json()["error"]["code"] == 404
        body = {**BASE, "max_tokens": 800, "temperature": 0, "stream": True}
        x = Exchange(json.dumps(body).encode())
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(x.run, s.app, "/v1/messages")
                await x.first_chunk.wait()
                r = await s.http.post("/v1/messages", json=BASE)
                assert anthropic_error(r, 503) == "overloaded_error"
                assert "retry-after" in r.headers
                x.hang_up.set()
        await s.wait_idle()

    async def broken(self: Any, body: Any, big: bool) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(MessagesServing, "count_tokens", broken)
    app = build_app(EngineSlot(), ServerConfig(model_name="tiny-random"))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        r = await http.post("/v1/messages/count_tokens", json=BASE)
        assert anthropic_error(r, 500) == "api_error"
        assert "RuntimeError" in r.json()["error"]["message"]


async def test_a_drain_refuses_then_cuts_a_stream_with_an_error_event() -> None:
    """New requests get Anthropic's 503; a stream cut by the drain ends with
    an ``error`` event in Anthropic's shape, and no ``[DONE]``."""
    body = {**BASE, "max_tokens": 800, "temperature": 0, "stream": True}
    async with open_server(engine=ENGINE) as s:
        x = Exchange(json.dumps(body).encode())
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(x.run, s.app, "/v1/messages")
                await x.first_chunk.wait()
                s.drain.start()
                r = await s.http.post("/v1/messages", json=BASE)
                assert anthropic_error(r, 503) == "overloaded_error"
                s.drain.cut()
                await s.drain.wait_idle()
        got = streamed(x.text)  # every event named, [DONE] would fail here
        assert got[0][0] == "message_start" and got[-1][0] == "error"
        assert got[-1][1]["error"]["type"] == "overloaded_error"
        assert "message_stop" not in [n for n, _ in got]
        await s.wait_idle()


async def test_request_timeout_is_408_or_a_last_error_event() -> None:
    engine = {"max_model_len": 2048, "num_blocks": 136}
    async with open_server(request_timeout=0.2, engine=engine) as s:
        body = {**BASE, "max_tokens": 2000, "temperature": 0}
        r = await s.http.post("/v1/messages", json=body)
        assert r.status_code == 408
        assert r.json()["error"]["type"] == "timeout_error"
        await s.wait_idle()
        r = await s.http.post("/v1/messages", json={**body, "stream": True})
        assert r.status_code == 200
        got = streamed(r.text)
        assert got[0][0] == "message_start" and got[-1][0] == "error"
        assert got[-1][1]["error"]["type"] == "timeout_error"
        assert "message_stop" not in [n for n, _ in got]
        await s.wait_idle()
        assert await s.metric('structllm_requests_total{finished_reason="abort"}') == 2


async def test_disconnect_mid_stream_aborts() -> None:
    body = {**BASE, "max_tokens": 800, "temperature": 0, "stream": True}
    async with open_server(engine=ENGINE) as s:
        x = Exchange(json.dumps(body).encode())
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(x.run, s.app, "/v1/messages")
                await x.first_chunk.wait()
                x.hang_up.set()
        await s.wait_idle()
        assert await s.metric('structllm_requests_total{finished_reason="abort"}') == 1
        assert "message_stop" not in x.text
        r = await s.http.post("/v1/messages", json=BASE)
        assert r.status_code == 200


async def test_x_api_key_beside_bearer() -> None:
    async with open_server(engine=ENGINE, api_key=("k1", "k2")) as s:
        for route, body in (
            ("/v1/messages", BASE),
            ("/v1/chat/completions", {**BASE, "messages": BASE["messages"]}),
        ):
            for headers in ({"x-api-key": "k2"}, {"Authorization": "Bearer k1"}):
                r = await s.http.post(route, json=body, headers=headers)
                assert r.status_code == 200, (route, headers, r.text)
            for headers in (
                {},
                {"x-api-key": "k3"},
                {"x-api-key": "Bearer k1"},
                {"x-api-key": ""},
                {"Authorization": "k1"},
            ):
                r = await s.http.post(route, json=body, headers=headers)
                assert r.status_code == 401, (route, headers)
                assert "k1" not in r.text and "k2" not in r.text
                anthropic_shape = route == "/v1/messages"
                assert (r.json().get("type") == "error") is anthropic_shape
        r = await s.http.post(
            "/v1/messages/count_tokens", json=BASE, headers={"x-api-key": "nope"}
        )
        assert r.json()["error"]["type"] == "authentication_error"


async def test_openapi_lists_the_routes() -> None:
    async with open_server(load=False) as s:
        doc = (await s.http.get("/openapi.json")).json()
        post = doc["paths"]["/v1/messages"]["post"]
        schema = post["requestBody"]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith("/MessagesRequest")
        assert (
            "max_tokens" in doc["components"]["schemas"]["MessagesRequest"]["required"]
        )
        assert post["responses"]["400"]["content"]["application/json"]["schema"][
            "$ref"
        ].endswith("/MessagesErrorResponse")
        assert "/v1/messages/count_tokens" in doc["paths"]


# -- the real anthropic client, behind a socket --------------------------------------


async def test_the_anthropic_client() -> None:
    async with (
        open_server(engine=ENGINE, api_key=("sk-test",)) as s,
        open_socket_server(s) as url,
    ):
        client = anthropic.AsyncAnthropic(
            base_url=url, api_key="sk-test", max_retries=0
        )
        convo: dict[str, Any] = dict(CONVERSATION)
        expected = (
            await s.http.post(
                "/v1/chat/completions",
                json={**CHAT_CONVERSATION, "max_tokens": 6, "temperature": 0},
                headers={"x-api-key": "sk-test"},
            )
        ).json()["choices"][0]["message"]["content"]

        message = await client.messages.create(
            model="tiny-random", max_tokens=6, extra_body=GREEDY, **convo
        )
        assert message.content[0].type == "text"
        assert message.content[0].text == expected
        assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6

        async with client.messages.stream(
            model="tiny-random", max_tokens=6, extra_body=GREEDY, **convo
        ) as stream:
            pieces = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        assert "".join(pieces) == expected and final.stop_reason == "max_tokens"

        tool_choice = {"type": "tool", "name": "get_weather"}
        ask = [{"role": "user", "content": "Weather?"}]
        used = await client.messages.create(
            model="tiny-random",
            max_tokens=60,
            extra_body=GREEDY,
            messages=ask,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=tool_choice,  # type: ignore[arg-type]
        )
        assert used.stop_reason == "tool_use" and used.content[0].type == "tool_use"
        async with client.messages.stream(
            model="tiny-random",
            max_tokens=60,
            extra_body=GREEDY,
            messages=ask,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=tool_choice,  # type: ignore[arg-type]
        ) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "tool_use"
        assert final.content[0].type == "tool_use"
        assert final.content[0].input == used.content[0].input

        counted = await client.messages.count_tokens(model="tiny-random", **convo)
        assert counted.input_tokens == message.usage.input_tokens

        with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
            await client.messages.create(
                model="tiny-random",
                max_tokens=0,
                messages=ask,  # type: ignore[arg-type]
            )
        wrong = anthropic.AsyncAnthropic(base_url=url, api_key="sk-no", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.create(model="tiny-random", max_tokens=2, messages=ask)  # type: ignore[arg-type]

        def sync() -> str:
            with (
                anthropic.Anthropic(
                    base_url=url, api_key="sk-test", max_retries=0
                ) as c,
                c.messages.stream(
                    model="tiny-random", max_tokens=6, extra_body=GREEDY, **convo
                ) as stream,
            ):
                return stream.get_final_text()

        assert await anyio.to_thread.run_sync(sync) == expected
        await client.close()
        await wrong.close()
        await s.wait_idle()
