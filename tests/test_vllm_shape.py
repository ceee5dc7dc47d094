"""What llama.cpp's and vLLM's clients find on the OpenAI routes (issue 33).

llama.cpp's top-level ``json_schema``, ``grammar`` and ``n_predict`` work as
the constraints and the limit they name; two assistant messages in a row
reach the chat template, as vLLM passes them; the responses carry vLLM's
fields as ``null`` when not asked for; ``/tokenize``'s ``token_strs`` are
vocabulary entries; ``top_logprobs`` objects start with the token itself;
``GET /tokenizer_info`` and ``POST /v1/chat/completions/batch`` answer.

The built-in ``tiny`` model (a byte-level BPE, a ChatML template) serves in
process on both AnyIO backends, through ``httpx`` and, over a loopback
socket, the real ``openai`` client (the synchronous one, in a worker thread,
as in ``test_server_structured.py``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import attrs
import httpx
import openai
import pytest

from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.server.app import build_app
from structllm.server.completions.protocol import CompletionRequest
from structllm.server.http.body import validate
from structllm.server.http.drain import Drain
from structllm.server.jobs import JobTiming
from structllm.server.protocol import bodies
from structllm.server.serving import EngineSlot, ServerConfig
from tests.test_server_app import Server, events, open_socket_server

pytestmark = pytest.mark.anyio

MODEL = "tiny"
ENGINE = {"max_model_len": 256, "num_blocks": 64, "block_size": 16}
CHAT = [{"role": "user", "content": "Say hi"}]
GREEDY = {"temperature": 0, "seed": 0}


@contextlib.asynccontextmanager
async def open_tiny(**config: Any) -> AsyncIterator[Server]:
    """``tiny`` behind the app, with these ``ServerConfig`` fields."""
    slot, drain = EngineSlot(), Drain()
    app = build_app(slot, ServerConfig(model_name=MODEL, **config), drain)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        kw = {"executor": "inline", "show_progress": False, **ENGINE}
        async with AsyncLLM.open(MODEL, **kw) as llm:
            slot.llm = llm
            try:
                yield Server(app, slot, drain, http)
            finally:
                slot.llm = None


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with open_tiny() as s:
        yield s


async def post(s: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await s.http.post(path, json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def refused(s: Server, path: str, body: dict[str, Any], param: str) -> str:
    r = await s.http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


# -- llama.cpp's fields on the OpenAI routes ---------------------------------------


async def test_llamacpp_json_schema_and_grammar_hold_the_output(
    server: Server,
) -> None:
    """The issue's request answered free text; the schema now holds it."""
    body = {"max_tokens": 6, "json_schema": {"const": "42"}, **GREEDY}
    chat = await post(server, "/v1/chat/completions", {"messages": CHAT, **body})
    assert json.loads(chat["choices"][0]["message"]["content"]) == "42"
    done = await post(server, "/v1/completions", {"prompt": "The answer:", **body})
    assert json.loads(done["choices"][0]["text"]) == "42"

    gbnf = 'root ::= "yes" | "no"'  # llama.cpp's dialect, converted
    for path, base in (
        ("/v1/completions", {"prompt": "Well?"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ):
        got = await post(server, path, {**base, "max_tokens": 4, "grammar": gbnf})
        choice = got["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert text in ("yes", "no") and choice["finish_reason"] == "stop"


async def test_llamacpp_fields_are_refused_by_name_when_wrong(server: Server) -> None:
    two = {"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}
    message = await refused(
        server, "/v1/completions", {"prompt": "x", **two}, "grammar"
    )
    assert "json_schema" in message
    fmt = {"response_format": {"type": "json_object"}, "json_schema": {}}
    await refused(
        server, "/v1/chat/completions", {"messages": CHAT, **fmt}, "json_schema"
    )
    await refused(
        server, "/v1/completions", {"prompt": "x", "grammar": "root ::= ("}, "grammar"
    )
    await refused(
        server, "/v1/completions", {"prompt": "x", "json_schema": "{}"}, "json_schema"
    )


async def test_n_predict_is_max_tokens(server: Server) -> None:
    body = {"prompt": "Once", "n_predict": 3, "ignore_eos": True}
    done = await post(server, "/v1/completions", body)
    assert done["usage"]["completion_tokens"] == 3
    chat = {"messages": CHAT, "n_predict": 2, "ignore_eos": True}
    answer = await post(server, "/v1/chat/completions", chat)
    assert answer["usage"]["completion_tokens"] == 2
    # the same value twice is one limit
    same = await post(server, "/v1/completions", {**body, "max_tokens": 3})
    assert same["usage"]["completion_tokens"] == 3
    # -1: no limit of its own (completions' default, as without max_tokens)
    unlimited = validate(CompletionRequest, {"prompt": "Once", "n_predict": -1})
    assert unlimited.max_tokens is None

    for bad in (
        {**body, "max_tokens": 4},
        {**body, "n_predict": -1, "max_tokens": 4},
        {**body, "n_predict": 0},
        {**body, "n_predict": "3"},
        {**body, "n_predict": 2**31},
    ):
        await refused(server, "/v1/completions", bad, "n_predict")
    message = await refused(
        server,
        "/v1/chat/completions",
        {**chat, "max_completion_tokens": 5},
        "n_predict",
    )
    assert "max_completion_tokens" in message
    # over the context, the error names the field the client sent
    long = {"n_predict": ENGINE["max_model_len"]}
    await refused(server, "/v1/completions", {"prompt": "Once", **long}, "n_predict")
    await refused(server, "/v1/chat/completions", {**chat, **long}, "n_predict")


async def test_consecutive_assistant_messages_reach_the_template(
    server: Server,
) -> None:
    """vLLM neither merges nor refuses them (its chat_utils passes each
    message to the template); neither does structllm, and none is dropped."""
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "First part."},
        {"role": "assistant", "content": "Second part."},
    ]
    ids = (await post(server, "/tokenize", {"messages": messages}))["tokens"]
    text = (await post(server, "/detokenize", {"tokens": ids}))["prompt"]
    assert text.index("First part.") < text.index("Second part.")
    assert text.count("<|im_start|>assistant") == 3  # two messages, one prompt
    body = {"messages": messages, "max_tokens": 2, "return_token_ids": True}
    answer = await post(server, "/v1/chat/completions", body)
    assert answer["prompt_token_ids"] == ids


# -- vLLM's response shape -----------------------------------------------------------


async def test_vllm_fields_are_null_when_not_asked_for(server: Server) -> None:
    done = await post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    choice = done["choices"][0]
    for key in ("prompt_logprobs", "prompt_token_ids", "token_ids"):
        assert key in choice and choice[key] is None, key
    chat = await post(
        server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}
    )
    assert chat["prompt_logprobs"] is None and chat["prompt_token_ids"] is None
    assert "token_ids" in chat["choices"][0]
    assert chat["choices"][0]["token_ids"] is None

    # ignore_eos: eight tokens, streamed in one chunk or several (tokens made
    # while the client reads the last chunk come together in the next one)
    asked = {
        "prompt": "Hi",
        "max_tokens": 8,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    got = (await post(server, "/v1/completions", asked))["choices"][0]
    assert got["prompt_token_ids"] and got["token_ids"]

    # streamed: every choice carries vLLM's keys; the prompt's ids once
    r = await server.http.post("/v1/completions", json={**asked, "stream": True})
    chunks = [e for e in events(r.text) if e != "[DONE]"]
    choices = [c for e in chunks for c in e["choices"]]
    assert sum(len(c["token_ids"] or ()) for c in choices) == 8
    for c in choices:
        assert {"text", "stop_reason", "prompt_token_ids", "token_ids"} <= set(c)
        assert "prompt_logprobs" not in c  # vLLM does not stream them
    assert choices[0]["prompt_token_ids"] == got["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert choices[0]["stop_reason"] is None


async def test_top_logprobs_name_the_token_first(server: Server) -> None:
    """vLLM's clients read ``next(iter(top))`` as the token at that position
    (vLLM's test_return_tokens_as_ids), the echoed prompt's included."""
    body = {
        "prompt": "Say 'Hello, world! 🎉'",
        "echo": True,
        "max_tokens": 6,
        "logprobs": 1,
        **GREEDY,
    }
    for as_ids in (True, False):
        extra = {"return_tokens_as_token_ids": as_ids}
        lp = (await post(server, "/v1/completions", {**body, **extra}))["choices"][0][
            "logprobs"
        ]
        assert lp["top_logprobs"][0] is None  # nothing predicts the first token
        firsts = [next(iter(top)) for top in lp["top_logprobs"][1:]]
        assert firsts == lp["tokens"][1:]
        assert all(len(top) <= 2 for top in lp["top_logprobs"][1:])
        if as_ids:
            assert all(t.startswith("token_id:") for t in lp["tokens"])
        # streamed, the same objects
        r = await server.http.post(
            "/v1/completions", json={**body, **extra, "stream": True}
        )
        streamed = [
            top
            for e in events(r.text)
            if e != "[DONE]"
            for c in e["choices"]
            for top in c["logprobs"]["top_logprobs"]
        ]
        assert streamed == lp["top_logprobs"]


async def test_no_streamed_chunk_without_tokens(server: Server) -> None:
    """vLLM skips an output with no text and no tokens; structllm sends
    none. A chunk whose text is held back (the first bytes of a character
    split over tokens: logit_bias pushes byte tokens) carries its tokens,
    with ``text: ""``, as vLLM's does."""
    # ids 128-189: single bytes of multi-byte characters in tiny's vocabulary
    bias = {str(i): 20 for i in range(128, 190)}
    body = {
        "max_tokens": 12,
        "stream": True,
        "return_token_ids": True,
        "logit_bias": bias,
        **GREEDY,
    }
    for path, base in (
        ("/v1/completions", {"prompt": "日本"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ):
        r = await server.http.post(path, json={**base, **body})
        chunks = [e for e in events(r.text) if e != "[DONE]"]
        held = 0
        for e in chunks[1 if "messages" in base else 0 :]:  # chat: the role chunk
            for c in e["choices"]:
                text = c["text"] if "text" in c else c["delta"].get("content")
                assert c["token_ids"], c
                held += not text
        assert held, "no chunk held its text back: the bias no longer splits"


async def test_token_strs_are_vocabulary_entries(server: Server) -> None:
    body = {"prompt": "Hello i", "add_special_tokens": False}
    plain = await post(server, "/tokenize", body)
    assert plain["token_strs"] is None
    got = await post(server, "/tokenize", {**body, "return_token_strs": True})
    # tiny's BPE: " i" is the byte "Ġ" then "i"; vLLM's convert_ids_to_tokens
    assert "".join(got["token_strs"]) == "HelloĠi"
    assert got["token_strs"][-2:] == ["Ġ", "i"]
    chat = {"messages": CHAT, "return_token_strs": True}
    strs = (await post(server, "/tokenize", chat))["token_strs"]
    assert strs[0] == "<|im_start|>" and "<|im_end|>" in strs


async def test_tokenizer_info(server: Server) -> None:
    r = await server.http.get("/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] == "HFTokenizer"
    assert info["eos_token"] == "<|endoftext|>" and info["bos_token"] is None
    assert "<|im_start|>" in info["chat_template"]
    assert info["model_max_length"] == ENGINE["max_model_len"]
    assert info["added_tokens_decoder"]["2"] == "<|im_end|>"


# -- vLLM's per-request metrics ------------------------------------------------------

METRICS = {
    "time_to_first_token_ms",
    "generation_time_ms",
    "queue_time_ms",
    "mean_itl_ms",
    "tokens_per_second",
}


def test_metrics_from_timings() -> None:
    """vLLM's arithmetic: scheduled at start + queue time; the ITL over the
    gaps between tokens; tokens/s from being scheduled to the last token."""
    timing = JobTiming(start=1.0, first=2.0, last=3.0, queue_time=0.5, tokens=10)
    got = bodies.dump(timing.metrics())
    assert got == pytest.approx(
        {
            "time_to_first_token_ms": 500.0,
            "generation_time_ms": 1000.0,
            "queue_time_ms": 500.0,
            "mean_itl_ms": 1000.0 / 9,
            "tokens_per_second": 10 / 1.5,
        }
    )
    one = bodies.dump(attrs.evolve(timing, tokens=1).metrics())
    assert one["mean_itl_ms"] is None and one["tokens_per_second"] == 1 / 1.5
    unknown = bodies.dump(JobTiming(start=1.0, queue_time=0.25).metrics())
    assert unknown == {**dict.fromkeys(METRICS), "queue_time_ms": 250.0}


async def test_per_request_metrics(server: Server) -> None:
    """With --enable-per-request-metrics: whole responses of one choice carry
    them, a stream in its closing usage chunk only; several choices, several
    prompts and ``include_metrics: false`` get null. Without the flag they are
    null and ``include_metrics: true`` is refused by name."""
    five = {"max_tokens": 5, "ignore_eos": True}
    routes = (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    )
    async with open_tiny(enable_per_request_metrics=True) as s:
        for path, base in routes:
            got = (await post(s, path, {**base, **five}))["metrics"]
            assert set(got) == METRICS, got
            assert all(v >= 0 for v in got.values()), got
            assert got["tokens_per_second"] > 0
            assert got["mean_itl_ms"] == pytest.approx(got["generation_time_ms"] / 4)
            several = await post(s, path, {**base, **five, "n": 2})
            assert several["metrics"] is None
            off = {**base, **five, "include_metrics": False}
            assert (await post(s, path, off))["metrics"] is None
            usage = {"stream": True, "stream_options": {"include_usage": True}}
            r = await s.http.post(path, json={**base, **five, **usage})
            chunks = [e for e in events(r.text) if e != "[DONE]"]
            assert set(chunks[-1]["metrics"]) == METRICS
            assert chunks[-1]["usage"]["completion_tokens"] == 5
            assert not any("metrics" in c for c in chunks[:-1])
        two = {"prompt": ["Hi", "there"], **five}
        assert (await post(s, "/v1/completions", two))["metrics"] is None
        batch = {"messages": [CHAT, CHAT], **five}
        got = await post(s, "/v1/chat/completions/batch", batch)
        assert got["metrics"] is None  # two conversations
        batch = {"messages": [CHAT], **five}
        got = await post(s, "/v1/chat/completions/batch", batch)
        assert set(got["metrics"]) == METRICS
    batch = {"messages": [CHAT], "include_metrics": True}
    await refused(server, "/v1/chat/completions/batch", batch, "include_metrics")
    for path, base in routes:  # the fixture's server: no flag
        got = await post(server, path, {**base, "max_tokens": 2})
        assert "metrics" in got and got["metrics"] is None  # vLLM's null
        await refused(
            server, path, {**base, "include_metrics": True}, "include_metrics"
        )
        off = {**base, "max_tokens": 2, "include_metrics": False}
        assert (await post(server, path, off))["metrics"] is None


# -- /v1/chat/completions/batch --------------------------------------------------


async def test_batch_chat_answers_each_conversation(server: Server) -> None:
    conversations = [
        [{"role": "user", "content": "Reply with alpha"}],
        [{"role": "user", "content": "Reply with beta, please"}],
    ]
    body = {"max_tokens": 4, "return_token_ids": True, **GREEDY}
    batch = await post(
        server, "/v1/chat/completions/batch", {"messages": conversations, **body}
    )
    assert batch["object"] == "chat.completion"
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    prompt_tokens = 0
    for conversation, choice in zip(conversations, batch["choices"], strict=True):
        alone = await post(
            server, "/v1/chat/completions", {"messages": conversation, **body}
        )
        assert choice["message"] == alone["choices"][0]["message"]
        assert choice["token_ids"] == alone["choices"][0]["token_ids"]
        prompt_tokens += alone["usage"]["prompt_tokens"]
    assert batch["usage"]["prompt_tokens"] == prompt_tokens
    assert batch["usage"]["completion_tokens"] == sum(
        len(c["token_ids"]) for c in batch["choices"]
    )

    schema = {"type": "string", "enum": ["yes", "no"]}
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema},
    }
    held = await post(
        server,
        "/v1/chat/completions/batch",
        {"messages": conversations, "response_format": fmt, "max_tokens": 6},
    )
    for choice in held["choices"]:
        assert json.loads(choice["message"]["content"]) in ("yes", "no")


async def test_batch_chat_refuses_what_vllm_refuses(server: Server) -> None:
    path = "/v1/chat/completions/batch"
    two = [CHAT, CHAT]
    await refused(server, path, {"messages": two, "stream": True}, "stream")
    await refused(server, path, {"messages": two, "n": 2}, "n")
    tools = [{"type": "function", "function": {"name": "f"}}]
    await refused(server, path, {"messages": two, "tools": tools}, "tools")
    await refused(server, path, {"messages": two, "tool_choice": "auto"}, "tool_choice")
    await refused(server, path, {"messages": []}, "messages")
    await refused(server, path, {"messages": [CHAT, []]}, "messages[1]")
    bad = [CHAT, [{"role": "user", "content": 5}]]
    await refused(server, path, {"messages": bad}, "messages[1][0].content")
    # a shared field is named as it is, once
    await refused(server, path, {"messages": two, "max_tokens": 0}, "max_tokens")
    await refused(
        server, path, {"messages": two, "use_beam_search": True}, "use_beam_search"
    )


# -- the real openai client over a socket ---------------------------------------------


@pytest.fixture
async def client(server: Server) -> AsyncIterator[openai.OpenAI]:
    async with open_socket_server(server) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        try:
            yield c
        finally:
            c.close()


def through_the_client(client: openai.OpenAI) -> None:
    done = client.completions.create(
        model=MODEL,
        prompt="The answer:",
        max_tokens=6,
        temperature=0,
        extra_body={"json_schema": {"const": "42"}},
    )
    assert json.loads(done.choices[0].text) == "42"
    dump = done.model_dump()["choices"][0]
    # vLLM's upstream check (test_return_token_ids): the key is there, null
    assert "prompt_token_ids" in dump and dump["prompt_token_ids"] is None

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Well?"}],
        extra_body={"grammar": 'root ::= "yes" | "no"', "n_predict": 4},
    )
    assert chat.choices[0].message.content in ("yes", "no")
    assert chat.model_dump()["prompt_logprobs"] is None

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"n_predict": 3}
        )
    assert e.value.body is not None and e.value.body["param"] == "n_predict"

    batch = client.post(
        "/chat/completions/batch",
        body={"messages": [CHAT, CHAT], "max_tokens": 2, "temperature": 0},
        cast_to=openai.types.chat.ChatCompletion,
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].message.content == batch.choices[1].message.content


async def test_openai_client_sees_the_llamacpp_fields_and_vllm_shape(
    client: openai.OpenAI,
) -> None:
    await anyio.to_thread.run_sync(through_the_client, client)
