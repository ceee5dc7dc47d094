"""The operational routes and records: /tokenize, /detokenize, /version,
/v1/models/{id}, X-Request-Id and the access log (CORS and the limits are
in tests/test_server_limits.py).

In process, through ``httpx.ASGITransport`` on both AnyIO backends (the
app around an inline ``AsyncLLM``, as in tests/test_server_app.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

import structllm
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.server.app import build_app
from structllm.server.http.access import ACCESS_LOGGER, MAX_REQUEST_ID
from structllm.server.protocol.bodies import ErrorResponse
from structllm.server.serving import EngineSlot, ServerConfig
from tests.test_server_app import events

pytestmark = pytest.mark.anyio

ENGINE = {"max_model_len": 256, "num_blocks": 64, "block_size": 16}
CHAT = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
TEXT = "Héllo wörld, ☃ and 日本語!"


@contextlib.asynccontextmanager
async def open_app(
    model: str = "tiny-random", *, load: bool = True, **config: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Any, EngineSlot]]:
    slot = EngineSlot()
    app = build_app(slot, ServerConfig(model_name=model, **config))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        if not load:
            yield http, app, slot
            return
        kw = {"executor": "inline", "show_progress": False, **ENGINE}
        async with AsyncLLM.open(model, **kw) as llm:
            slot.llm = llm
            try:
                yield http, app, slot
            finally:
                slot.llm = None


def openai_error(r: httpx.Response, status: int, param: str | None = None) -> str:
    """The message of an OpenAI-shaped error ``r`` with ``status`` and ``param``."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = ErrorResponse.model_validate(r.json()).error
    assert err.code == status and err.param == param, r.json()
    return err.message


# -- /tokenize and /detokenize ----------------------------------------------------


@pytest.mark.parametrize("model", ["tiny-random", "tiny"])
async def test_tokenize_matches_what_generation_sees_and_round_trips(
    model: str,
) -> None:
    async with open_app(model) as (http, _, slot):
        assert slot.llm is not None
        r = await http.post("/tokenize", json={"model": model, "prompt": TEXT})
        got = r.json()
        completion = await http.post(
            "/v1/completions",
            json={"prompt": TEXT, "max_tokens": 1, "return_token_ids": True},
        )
        assert got["tokens"] == completion.json()["choices"][0]["prompt_token_ids"]
        assert got["count"] == len(got["tokens"])
        assert got["max_model_len"] == slot.llm.max_model_len == 256
        assert got["token_strs"] is None  # vLLM's null when not asked for

        r = await http.post(
            "/tokenize",
            json={
                "prompt": TEXT,
                "add_special_tokens": False,
                "return_token_strs": True,
            },
        )
        plain = r.json()
        assert len(plain["token_strs"]) == plain["count"]
        back = await http.post("/detokenize", json={"tokens": plain["tokens"]})
        # vLLM's "prompt", and llama.cpp's "content" (the same request)
        assert back.status_code == 200
        assert back.json() == {"prompt": TEXT, "content": TEXT}
        if model == "tiny":  # a real BPE: fewer tokens than UTF-8 bytes
            assert plain["count"] < len(TEXT.encode())
            # vocabulary entries, as transformers' convert_ids_to_tokens: a
            # byte-level BPE spells bytes as printable characters, no U+FFFD
            assert "\ufffd" not in "".join(plain["token_strs"])
        ascii_only = {"prompt": "Hello world", "return_token_strs": True}
        r = await http.post(
            "/tokenize", json={**ascii_only, "add_special_tokens": False}
        )
        # tiny's BPE writes the space as "Ġ"; the byte tokenizer's entries
        # are the bytes' text
        words = "HelloĠworld" if model == "tiny" else "Hello world"
        assert "".join(r.json()["token_strs"]) == words

        r = await http.post("/tokenize", json={"messages": CHAT})
        chat = await http.post(
            "/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 1, "return_token_ids": True},
        )
        assert r.json()["tokens"] == chat.json()["prompt_token_ids"]
        tools = [{"type": "function", "function": {"name": "get_time"}}]
        r_tools = await http.post("/tokenize", json={"messages": CHAT, "tools": tools})
        chat_tools = await http.post(
            "/v1/chat/completions",
            json={
                "messages": CHAT,
                "tools": tools,
                "max_tokens": 1,
                "return_token_ids": True,
            },
        )
        assert chat_tools.status_code == 200, chat_tools.text
        assert r_tools.json()["tokens"] == chat_tools.json()["prompt_token_ids"]
        without = await http.post(
            "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}
        )
        assert without.json()["count"] < r.json()["count"]
        text = (await http.post("/detokenize", json=r.json())).json()["prompt"]
        assert "Say hi" in text and text.count("hi") >= 2


async def test_continue_final_message_and_template_kwargs_in_chat_and_tokenize() -> (
    None
):
    prefix = [*CHAT, {"role": "assistant", "content": "The capital of"}]
    async with open_app("tiny") as (http, _, _):
        body = {"messages": prefix, "continue_final_message": True}
        tokenized = (await http.post("/tokenize", json=body)).json()["tokens"]
        chat = await http.post(
            "/v1/chat/completions",
            json={**body, "max_tokens": 2, "return_token_ids": True},
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["prompt_token_ids"] == tokenized
        text = (await http.post("/detokenize", json={"tokens": tokenized})).json()
        assert text["prompt"].endswith("<|im_start|>assistant\nThe capital of")
        closed = {"messages": prefix, "add_generation_prompt": False}
        closed_ids = (await http.post("/tokenize", json=closed)).json()["tokens"]
        assert len(closed_ids) > len(tokenized)  # the turn ends: <|im_end|>
        for path in ("/tokenize", "/v1/chat/completions"):
            both = {**body, "add_generation_prompt": True}
            openai_error(
                await http.post(path, json=both), 400, "continue_final_message"
            )
            kwargs = {"messages": CHAT, "chat_template_kwargs": {"messages": []}}
            r = await http.post(path, json=kwargs)
            openai_error(r, 400, "chat_template_kwargs.messages")
            kwargs = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": 1}}
            assert (
                await http.post(path, json={**kwargs, "max_tokens": 1})
            ).status_code == 200


async def test_tokenize_and_detokenize_refusals_name_the_field() -> None:
    async with open_app() as (http, _, _):
        post = http.post
        openai_error(
            await post("/detokenize", json={"tokens": [104, 258]}), 400, "tokens[1]"
        )
        openai_error(await post("/detokenize", json={"tokens": [-1]}), 400, "tokens[0]")
        openai_error(
            await post("/detokenize", json={"tokens": [2**40]}), 400, "tokens[0]"
        )
        openai_error(await post("/detokenize", json={"tokens": "104"}), 400, "tokens")
        openai_error(await post("/detokenize", json={}), 400, "tokens")
        openai_error(await post("/tokenize", json={"prompt": 5}), 400, "prompt")
        openai_error(await post("/tokenize", json={"messages": []}), 400, "messages")
        lone = b'{"prompt": "\\ud800"}'  # a lone surrogate, as JSON may spell it
        openai_error(await post("/tokenize", content=lone), 400, "prompt")
        openai_error(await post("/tokenize", json=[1]), 400, None)
        openai_error(await post("/tokenize", content=b"{"), 400, None)
        refused = {"messages": CHAT, "chat_template": "{{ x }}"}
        openai_error(await post("/tokenize", json=refused), 400, "chat_template")
        openai_error(
            await post("/tokenize", json={"model": "gpt-4", "prompt": "x"}),
            404,
            "model",
        )
        openai_error(
            await post("/detokenize", json={"model": "gpt-4", "tokens": [1]}),
            404,
            "model",
        )


async def test_tokenize_respects_the_prompt_byte_cap() -> None:
    async with open_app() as (http, _, slot):
        assert slot.llm is not None
        cap = slot.llm.max_prompt_bytes
        assert cap is not None
        r = await http.post("/tokenize", json={"prompt": "a" * (cap + 1)})
        assert "max_prompt_bytes" in openai_error(r, 400, "prompt")
        long = {"messages": [{"role": "user", "content": "é" * cap}]}
        openai_error(await http.post("/tokenize", json=long), 400, "messages")
        # just under the cap: tokenised (in a worker thread) and counted
        r = await http.post("/tokenize", json={"prompt": "a" * (cap - 8)})
        assert r.json()["count"] == cap - 8 + 1  # bytes + BOS


# -- /version and /v1/models/{id} -------------------------------------------------


async def test_version_and_model_by_id() -> None:
    async with open_app() as (http, _, _):
        r = await http.get("/version")
        assert r.json() == {"version": structllm.__version__}
        r = await http.get("/v1/models/tiny-random")
        card = r.json()
        assert card["id"] == "tiny-random" and card["object"] == "model"
        assert card == (await http.get("/v1/models")).json()["data"][0]
        message = openai_error(await http.get("/v1/models/org/other"), 404, "model")
        assert "'org/other'" in message
    async with open_app(load=False) as (http, _, _):
        r = await http.get("/v1/models/tiny-random")
        openai_error(r, 503)
        assert r.headers["retry-after"] == "1"
        assert (await http.get("/version")).status_code == 200


async def test_openapi_describes_the_new_routes() -> None:
    async with open_app(load=False, api_key=("k",)) as (_, app, _):
        doc = app.openapi()
    paths = doc["paths"]
    body = paths["/tokenize"]["post"]["requestBody"]["content"]["application/json"]
    refs = {s["$ref"].rsplit("/", 1)[1] for s in body["schema"]["anyOf"]}
    assert refs == {"TokenizeCompletionRequest", "TokenizeChatRequest"}
    schemas = doc["components"]["schemas"]
    assert schemas["TokenizeCompletionRequest"]["required"] == ["prompt"]
    assert schemas["DetokenizeRequest"]["required"] == ["tokens"]
    # token_strs: null unless asked for, as vLLM sends it
    assert schemas["TokenizeResponse"]["required"] == [
        "count", "max_model_len", "tokens", "token_strs",
    ]  # fmt: skip
    assert "/v1/models/{model_id}" in paths and "/version" in paths
    assert "/tokenizer_info" in paths and "/v1/chat/completions/batch" in paths
    assert "401" in paths["/v1/completions"]["post"]["responses"]
    assert "401" not in paths["/version"]["get"]["responses"]
    assert doc["info"]["version"] == structllm.__version__


# -- X-Request-Id -----------------------------------------------------------------


async def test_request_id_is_echoed_on_every_response() -> None:
    async with open_app(api_key=("k",)) as (http, _, _):
        key = {"Authorization": "Bearer k"}
        body = {"prompt": "x", "max_tokens": 2}
        stream = {**body, "stream": True}
        cases = [
            ("POST", "/v1/completions", {"json": body, "headers": key}, 200),
            ("POST", "/v1/completions", {"json": stream, "headers": key}, 200),
            ("POST", "/v1/completions", {"json": {"prompt": 1}, "headers": key}, 400),
            ("POST", "/v1/completions", {"json": body}, 401),
            ("GET", "/nope", {}, 404),
            ("GET", "/health", {}, 200),
            ("POST", "/health", {}, 405),
        ]
        for method, path, kw, status in cases:
            headers = {**kw.pop("headers", {}), "X-Request-Id": "trace-42"}
            r = await http.request(method, path, headers=headers, **kw)
            assert r.status_code == status, (path, r.text)
            assert r.headers["x-request-id"] == "trace-42", path
            mine = (await http.request(method, path, headers=headers, **kw)).headers
            assert mine["x-request-id"] == "trace-42"
        # none given, or not a sane one: a fresh id each time
        seen = set()
        for given in (None, "", "a b", "x" * (MAX_REQUEST_ID + 1), "tab\there"):
            headers = {} if given is None else {"X-Request-Id": given}
            rid = (await http.get("/health", headers=headers)).headers["x-request-id"]
            assert rid != given and len(rid) == 32 and rid not in seen
            seen.add(rid)
        ok = "A-Za-z0-9._~:/!" + "x" * (MAX_REQUEST_ID - 15)
        r = await http.get("/health", headers={"X-Request-Id": ok})
        assert r.headers["x-request-id"] == ok


async def test_request_id_names_the_engine_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names: list[str | None] = []
    stream = AsyncLLM.stream

    def spy(self: AsyncLLM, *args: Any, **kw: Any) -> Any:
        names.append(kw.get("request_id"))
        return stream(self, *args, **kw)

    monkeypatch.setattr(AsyncLLM, "stream", spy)
    async with open_app() as (http, _, _):
        headers = {"X-Request-Id": "trace-7"}
        body = {"prompt": "x", "max_tokens": 20, "n": 2, "ignore_eos": True}
        async with anyio.create_task_group() as tg:  # the same id twice at once
            for _ in range(2):
                tg.start_soon(
                    lambda: http.post("/v1/completions", json=body, headers=headers)
                )
        stream_body = {**body, "stream": True}
        r = await http.post("/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 2, "stream": True,
        }, headers=headers)  # fmt: skip
        assert events(r.text)[-1] == "[DONE]"
        r = await http.post("/v1/completions", json=stream_body)
    assert len(names) == 2 + 2 + 1 + 2 and len(set(names)) == len(names)
    assert all(n is not None and n.startswith("trace-7-") for n in names[:5])
    assert {n.rsplit("-", 1)[1] for n in names[:4] if n} == {"0", "1"}
    generated = r.headers["x-request-id"]
    assert all(n is not None and n.startswith(generated) for n in names[5:])


# -- the access log ---------------------------------------------------------------


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER
    ]


async def test_access_log_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with open_app(api_key=("sk-log-secret",)) as (http, _, _):
        key = {"Authorization": "Bearer sk-log-secret", "X-Request-Id": "req-1"}
        body = {"prompt": "secret prompt text", "max_tokens": 5, "ignore_eos": True}
        r = await http.post("/v1/completions", json=body, headers=key)
        usage = r.json()["usage"]
        (line,) = access_lines(caplog)
        ttft, e2e = line.pop("ttft_s"), line.pop("e2e_s")  # timings: checked below
        assert line == {
            "request_id": "req-1",
            "method": "POST",
            "path": "/v1/completions",
            "status": 200,
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": 5,
            "finish_reason": "length",
        }
        assert isinstance(ttft, float) and isinstance(e2e, float)
        assert 0 < ttft <= e2e
        caplog.clear()
        stream = {**body, "stream": True, "n": 2, "stop": ["zzzz"]}
        await http.post("/v1/completions", json=stream, headers=key)
        await http.post("/v1/completions", json=body)  # no key
        first, refused = access_lines(caplog)
        assert first["completion_tokens"] == 10
        assert first["prompt_tokens"] == usage["prompt_tokens"]  # once, not per n
        assert first["finish_reason"] == "length,length"
        assert refused["status"] == 401 and refused["completion_tokens"] == 0
        assert refused["ttft_s"] is None and refused["finish_reason"] is None
        assert "secret prompt" not in caplog.text
        assert "sk-log-secret" not in caplog.text


async def test_access_log_prompt_only_up_to_max_log_len_and_can_be_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    body = {"prompt": "0123456789abcdef", "max_tokens": 1}
    async with open_app(max_log_len=10) as (http, _, _):
        await http.post("/v1/completions", json=body)
        await http.post(
            "/v1/completions", json={"prompt": [65, 66, 67], "max_tokens": 1}
        )
        await http.post(
            "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}
        )
    text, ids, chat = access_lines(caplog)
    assert text["prompt"] == "0123456789"
    assert ids["prompt"] == "ABC"
    assert len(chat["prompt"]) == 10
    caplog.clear()
    async with open_app(access_log=False) as (http, _, _):
        await http.post("/v1/completions", json=body)
    assert access_lines(caplog) == []
