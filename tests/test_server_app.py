"""The server app in process: every route, error mapping, SSE, disconnects, drain.

No socket and no process: ``build_app`` over an inline ``AsyncLLM``, driven
through ``httpx.ASGITransport`` on both AnyIO backends, and once behind a
real loopback socket on hypercorn in this process. (tests/test_server.py
keeps ``structllm serve`` processes with the real ``openai`` client.)

``ASGITransport`` reads the whole response before returning it, and its
``receive()`` answers ``http.disconnect`` only once the response is
complete: it cannot hang up mid-response. The disconnect tests therefore
call the ASGI app directly, with a ``receive`` that hangs up at a chosen
moment, which is what hypercorn does when the peer closes its socket.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
import attrs
import httpx
import pytest

from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.params import SamplingParams
from structllm.server.app import build_app
from structllm.server.chat import protocol as chat_api
from structllm.server.completions import protocol as completions_api
from structllm.server.http.drain import Drain
from structllm.server.models import protocol as models_api
from structllm.server.protocol import bodies
from structllm.server.run import hypercorn_config, listen, serve_hypercorn
from structllm.server.serving import EngineSlot, ServerConfig
from tests.core_record import assert_core_holds_nothing

pytestmark = pytest.mark.anyio

ENGINE = {"max_model_len": 256, "num_blocks": 64, "block_size": 16}
LONG = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Say hi"}]


@attrs.define
class Server:
    app: Any
    slot: EngineSlot
    drain: Drain
    http: httpx.AsyncClient

    @property
    def llm(self) -> AsyncLLM:
        assert self.slot.llm is not None
        return self.slot.llm

    async def metric(self, name: str) -> float:
        text = (await self.http.get("/metrics")).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name)
        )

    async def wait_idle(self) -> None:
        """Until the server has released every request; then the core, asked
        (after the aborts those releases sent), holds none and no block."""
        with anyio.fail_after(10):
            await self.llm.wait_statistics(lambda s: s.live_requests == 0)
        await assert_core_holds_nothing(self.llm)


@contextlib.asynccontextmanager
async def open_server(
    *, load: bool = True, engine: dict[str, Any] | None = None, **config: Any
) -> AsyncIterator[Server]:
    slot, drain = EngineSlot(), Drain()
    app = build_app(slot, ServerConfig(model_name="tiny-random", **config), drain)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        server = Server(app, slot, drain, http)
        if not load:
            yield server
            return
        kw = {"executor": "inline", "show_progress": False, **ENGINE, **(engine or {})}
        async with AsyncLLM.open("tiny-random", **kw) as llm:
            slot.llm = llm
            try:
                yield server
            finally:
                slot.llm = None


def events(body: str, *, named: bool = False) -> list[Any]:
    """The ``data:`` events of an SSE body, JSON-decoded except ``[DONE]``
    (``named``: each has an ``event:`` line too, naming its ``type``)."""
    out: list[Any] = []
    for block in body.split("\n\n"):
        if block:
            name = None
            if named:
                name, block = block.split("\n", 1)
                assert name.startswith("event: "), name
            assert block.startswith("data: "), block
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
            if name is not None:
                assert out[-1]["type"] == name.removeprefix("event: ")
    return out


async def reference(llm: AsyncLLM, prompt: dict[str, Any], max_tokens: int) -> str:
    out = await llm.complete(
        prompt, SamplingParams(temperature=0, max_tokens=max_tokens)
    )
    return out.text


# -- routes ----------------------------------------------------------------------


async def test_completions_whole_and_streamed() -> None:
    async with open_server() as s:
        body = {"prompt": "Hello world", "max_tokens": 8, "temperature": 0}
        r = await s.http.post("/v1/completions", json=body)
        assert r.status_code == 200
        response = completions_api.CompletionResponse.model_validate(r.json())
        ids = (
            await s.http.post(
                "/v1/completions", json={**body, "return_token_ids": True}
            )
        ).json()
        prompt = {"prompt_token_ids": ids["choices"][0]["prompt_token_ids"]}
        assert response.choices[0].text == await reference(s.llm, prompt, 8)
        assert response.id.startswith("cmpl-") and response.usage.completion_tokens == 8
        assert set(r.json()["choices"][0]) == {
            "index", "text", "logprobs", "finish_reason", "stop_reason",
            "prompt_token_ids", "token_ids", "prompt_logprobs",  # vLLM's, null
        }  # fmt: skip

        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        r = await s.http.post("/v1/completions", json=stream)
        assert r.headers["content-type"].startswith("text/event-stream")
        got = events(r.text)
        assert got[-1] == "[DONE]"
        chunks = [
            completions_api.CompletionStreamResponse.model_validate(e) for e in got[:-1]
        ]
        assert "".join(c.choices[0].text or "" for c in chunks if c.choices) == (
            response.choices[0].text
        )
        assert len({c.id for c in chunks}) == 1
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 8
        assert "usage" not in got[0]  # only the last chunk, without continuous usage
        await s.wait_idle()


async def test_chat_whole_and_streamed() -> None:
    async with open_server() as s:
        body = {"messages": CHAT, "max_tokens": 6, "temperature": 0}
        r = await s.http.post("/v1/chat/completions", json=body)
        whole = chat_api.ChatCompletionResponse.model_validate(r.json())
        assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
        assert whole.choices[0].message.role == "assistant"
        r = await s.http.post("/v1/chat/completions", json={**body, "stream": True})
        got = events(r.text)
        assert got[-1] == "[DONE]"
        chunks = [
            chat_api.ChatCompletionStreamResponse.model_validate(e) for e in got[:-1]
        ]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == whole.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == "length"


async def test_n_choices_logprobs_and_token_ids() -> None:
    async with open_server() as s:
        body = {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 3, "logprobs": 1,
                "return_token_ids": True, "seed": 3}  # fmt: skip
        r = await s.http.post("/v1/completions", json=body)
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        assert all(len(c["token_ids"]) == 3 and c["prompt_token_ids"] for c in choices)
        assert all(len(c["logprobs"]["tokens"]) == 3 for c in choices)
        body = {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
        r = await s.http.post("/v1/chat/completions", json=body)
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 2 and all(len(t["top_logprobs"]) == 2 for t in content)


async def test_models_health_and_metrics() -> None:
    async with open_server(load=False) as s:
        health = await s.http.get("/health")
        assert health.status_code == 503 and health.content == b""
        r = await s.http.get("/v1/models")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        r = await s.http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        assert await s.metric("structllm_engine_healthy") == 0
    async with open_server() as s:
        health = await s.http.get("/health")
        assert health.status_code == 200
        assert health.json() == {"status": "ok"}  # llama.cpp's body
        models = models_api.ModelList.model_validate(
            (await s.http.get("/v1/models")).json()
        )
        assert [(m.id, m.max_model_len) for m in models.data] == [("tiny-random", 256)]
        await s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        r = await s.http.get("/metrics")
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert await s.metric('structllm_requests_total{finished_reason="length"}') == 1
        assert await s.metric("structllm_generation_tokens_total") == 3
        assert await s.metric("structllm_e2e_request_latency_seconds_count") == 1
        assert await s.metric("structllm_engine_healthy") == 1
        assert s.slot.llm is not None
        stats = s.slot.llm.statistics()
        assert await s.metric("structllm_kv_cache_bytes") == stats.kv_cache_bytes > 0
        assert await s.metric("structllm_engine_core_peak_rss_bytes") > 0
        if sys.platform == "linux":  # the server process's own
            assert await s.metric("process_resident_memory_bytes") > 0
        assert "_created" not in r.text


async def test_openapi_describes_requests_and_responses() -> None:
    async with open_server(load=False) as s:
        doc = (await s.http.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    for path, request, whole, chunk in [
        ("/v1/completions", "CompletionRequest", "CompletionResponse",
         "CompletionStreamResponse"),
        ("/v1/chat/completions", "ChatRequest", "ChatCompletionResponse",
         "ChatCompletionStreamResponse"),
    ]:  # fmt: skip
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith(f"/{request}")
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].endswith(f"/{whole}")
        assert ok["text/event-stream"]["schema"]["$ref"].endswith(f"/{chunk}")
        error = op["responses"]["400"]["content"]["application/json"]["schema"]
        assert error["$ref"].endswith("/ErrorResponse")
    models = doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]
    assert models["application/json"]["schema"]["$ref"].endswith("/ModelList")
    assert {"/health", "/metrics"} <= set(doc["paths"])
    # truthful about what is always sent and what only sometimes
    assert "token_ids" in schemas["CompletionChoice"]["required"]  # vLLM's null
    assert "usage" not in schemas["CompletionStreamResponse"]["required"]
    assert "stop_reason" in schemas["CompletionChoice"]["required"]
    assert (
        schemas["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["maximum"]
        == 2**31 - 1
    )
    every_ref = json.dumps(doc)
    for name in schemas:
        assert f'"#/components/schemas/{name}"' in every_ref or name.endswith("Request")


# -- errors ------------------------------------------------------------------------


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = bodies.ErrorResponse.model_validate(r.json()).error
    assert err.code == status and err.param == param
    return err.message


async def test_error_mapping() -> None:
    async with open_server(max_body_bytes=10_000) as s:
        post = s.http.post
        r = await post("/v1/completions", json={"prompt": "x", "max_tokens": 2**64})
        assert assert_error(r, 400, "max_tokens").startswith("max_tokens")
        r = await post("/v1/completions", json={"prompt": "x", "top_p": 0})
        assert_error(r, 400, "top_p")
        r = await post("/v1/chat/completions", json={"messages": "hi"})
        assert_error(r, 400, "messages")
        r = await post("/v1/completions", json={"prompt": "x", "tools": [{}]})
        assert_error(r, 400, "tools")
        r = await post("/v1/completions", json={"prompt": "x", "max_tokens": 300})
        assert "context length" in assert_error(r, 400, "max_tokens")
        r = await post("/v1/completions", content=b"{nope")
        assert "JSON" in assert_error(r, 400)
        r = await post("/v1/completions", content=b'{"prompt": NaN}')
        assert_error(r, 400)
        r = await post("/v1/completions", json={"prompt": "x", "model": "gpt-9"})
        assert_error(r, 404, "model")
        assert_error(await s.http.get("/v1/nothing"), 404)
        assert_error(await s.http.get("/v1/completions"), 405)
        r = await post("/v1/completions", content=b"x" * 20_000)
        assert_error(r, 413)
        form = {"content-type": "application/x-www-form-urlencoded"}
        r = await post("/v1/chat/completions", content=b"messages=hi", headers=form)
        assert "JSON" in assert_error(r, 415, "Content-Type")
        for json_type in ("application/json; charset=utf-8", "application/vnd.x+json"):
            r = await post(
                "/v1/completions",
                content=b'{"prompt": "ok", "max_tokens": 1}',
                headers={"content-type": json_type},
            )
            assert r.status_code == 200, json_type
        r = await post(
            "/v1/chat/completions", json={"messages": CHAT, "tool_choice": "auto"}
        )
        assert "needs tools" in assert_error(r, 400, "tool_choice")
        # the engine serves on after each
        r = await post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
        assert r.status_code == 200


async def test_overload_is_503_with_retry_after() -> None:
    engine = {"max_num_seqs": 1, "max_queued_requests": 0}
    async with open_server(engine=engine) as s, anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(s.http.post, "/v1/completions", json=LONG))
        with anyio.fail_after(10):
            await s.llm.wait_statistics(lambda st: st.running == 1)
        for path, body in [
            ("/v1/completions", {"prompt": "y"}),
            ("/v1/completions", {"prompt": "y", "stream": True}),
        ]:
            r = await s.http.post(path, json=body)
            assert_error(r, 503)
            assert r.headers["retry-after"] == "1"
        tg.cancel_scope.cancel()


async def test_request_timeout_is_408_or_a_last_event() -> None:
    # 2,000 tokens take over a second on the tiny model (~0.5-1 ms a token
    # with the CPU kernels: 250 tokens once took longer than 0.3 s, no more)
    engine = {"max_model_len": 2048, "num_blocks": 136}
    async with open_server(request_timeout=0.2, engine=engine) as s:
        body = {**LONG, "max_tokens": 2000}
        r = await s.http.post("/v1/completions", json=body)
        assert "longer than 0.2s" in assert_error(r, 408)
        await s.wait_idle()
        r = await s.http.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 200
        got = events(r.text)
        assert got[-1] == "[DONE]" and got[-2]["error"]["code"] == 408
        await s.wait_idle()
        assert await s.metric('structllm_requests_total{finished_reason="abort"}') == 2


# -- disconnects and drain: the ASGI app called directly --------------------------


@attrs.define
class Exchange:
    """One request to the ASGI app, with a ``receive`` we hang up on."""

    body: bytes
    hang_up: anyio.Event = attrs.Factory(anyio.Event)
    first_chunk: anyio.Event = attrs.Factory(anyio.Event)
    sent: list[dict[str, Any]] = attrs.Factory(list)
    _body_sent: bool = False

    async def receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            self.first_chunk.set()

    async def run(self, app: Any, path: str) -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
            "server": ("t", 80),
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(self.body)).encode())],
        }  # fmt: skip
        await app(scope, self.receive, self.send)

    @property
    def text(self) -> str:
        return b"".join(
            m.get("body", b"") for m in self.sent if m["type"] == "http.response.body"
        ).decode()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_disconnect_mid_stream_aborts(path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 200, "ignore_eos": True, "stream": True}
    body.update({"prompt": "x"} if "chat" not in path else {"messages": CHAT})
    async with open_server() as s:
        x = Exchange(json.dumps(body).encode())
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(x.run, s.app, path)
                await x.first_chunk.wait()
                x.hang_up.set()
        await s.wait_idle()
        assert await s.metric('structllm_requests_total{finished_reason="abort"}') == 1
        assert "[DONE]" not in x.text
        r = await s.http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
        assert r.status_code == 200


async def test_disconnect_before_the_response_aborts_every_choice() -> None:
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 200, "ignore_eos": True}
    async with open_server() as s:
        x = Exchange(json.dumps(body).encode())
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(x.run, s.app, "/v1/completions")
                await s.llm.wait_statistics(lambda st: st.running == 4)
                x.hang_up.set()
        await s.wait_idle()
        assert await s.metric('structllm_requests_total{finished_reason="abort"}') == 4
        assert x.sent[0]["status"] == 499


async def test_drain_refuses_new_requests_then_cuts_a_stream() -> None:
    body = {**LONG, "max_tokens": 250, "stream": True}
    async with open_server() as s:
        x = Exchange(json.dumps(body).encode())
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(x.run, s.app, "/v1/completions")
                await x.first_chunk.wait()
                s.drain.start()
                assert (await s.http.get("/health")).status_code == 503
                r = await s.http.post("/v1/completions", json={"prompt": "y"})
                assert_error(r, 503)
                assert s.drain.active == 1
                s.drain.cut()
                await s.drain.wait_idle()
        got = events(x.text)
        assert got[-1] == "[DONE]" and got[-2]["error"]["code"] == 503
        await s.wait_idle()


# -- the same app behind a real socket, in this process ---------------------------


@contextlib.asynccontextmanager
async def open_socket_server(s: Server) -> AsyncIterator[str]:
    """``s.app`` on hypercorn on a loopback port, under the test's own loop."""
    sock = listen("127.0.0.1", 0, 128)
    port = sock.getsockname()[1]
    config = hypercorn_config(sock, backlog=128, header_timeout=10)
    shutdown = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_hypercorn, s.app, config, shutdown)
            yield f"http://127.0.0.1:{port}"
            shutdown.set()
    finally:
        with contextlib.suppress(OSError):
            sock.close()


async def test_real_socket_stream_and_hang_up() -> None:
    """hypercorn sends the real http.disconnect when the peer closes."""
    async with open_server() as s, open_socket_server(s) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 3}
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        body = json.dumps({**LONG, "max_tokens": 250, "stream": True}).encode()
        port = int(url.rsplit(":", 1)[1])
        with anyio.fail_after(20):
            async with await anyio.connect_tcp("127.0.0.1", port) as conn:
                await conn.send(
                    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                    b"Content-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                received = b""
                while b"data: {" not in received:
                    received += await conn.receive()
            # closed after one chunk: hypercorn tells the app
        assert received.startswith(b"HTTP/1.1 200")
        await s.wait_idle()
        assert await s.metric('structllm_requests_total{finished_reason="abort"}') == 1
