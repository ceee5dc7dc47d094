"""CORS, the concurrency limits, and failures: a bug's 500, clients hanging up.

In process through ``httpx.ASGITransport`` on both AnyIO backends, and on
hypercorn behind a loopback socket (the hang-ups).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio
import httpx
import pytest

from structllm.server.app import build_app
from structllm.server.http.access import ACCESS_LOGGER
from structllm.server.serving import EngineSlot, ServerConfig
from tests.test_server_app import open_server, open_socket_server
from tests.test_server_ops import access_lines, open_app, openai_error

pytestmark = pytest.mark.anyio


# -- CORS -------------------------------------------------------------------------

PREFLIGHT = {
    "Origin": "https://app.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


async def test_no_cors_without_origins() -> None:
    async with open_app(load=False) as (http, _, _):
        r = await http.options("/v1/completions", headers=PREFLIGHT)
        assert r.status_code == 405
        assert not any(k.startswith("access-control-") for k in r.headers)
        r = await http.get("/health", headers={"Origin": "https://app.example"})
        assert not any(k.startswith("access-control-") for k in r.headers)


async def test_cors_preflight_with_origins_needs_no_key() -> None:
    async with open_app(allowed_origins=("https://app.example",), api_key=("k",)) as (
        http,
        _,
        _,
    ):
        r = await http.options("/v1/completions", headers=PREFLIGHT)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"]
        assert "access-control-allow-credentials" not in r.headers
        bad = {**PREFLIGHT, "Origin": "https://evil.example"}
        r = await http.options("/v1/completions", headers=bad)
        assert "origin" in openai_error(r, 400)
        r = await http.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"Origin": "https://app.example", "Authorization": "Bearer k"},
        )
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert r.headers["access-control-expose-headers"] == "X-Request-Id"
        r = await http.post(
            "/v1/completions", headers={"Origin": "https://app.example"}
        )
        openai_error(r, 401)  # the key is still needed; the 401 is readable
        assert r.headers["access-control-allow-origin"] == "https://app.example"
    async with open_app(
        load=False,
        allowed_origins=("https://app.example",),
        allowed_methods=("GET",),
        allow_credentials=True,
    ) as (http, _, _):
        r = await http.options("/v1/completions", headers=PREFLIGHT)
        assert "method" in openai_error(r, 400)
        get = {**PREFLIGHT, "Access-Control-Request-Method": "GET"}
        r = await http.options("/v1/models", headers=get)
        assert r.headers["access-control-allow-credentials"] == "true"


# -- concurrency limits -----------------------------------------------------------


async def test_concurrency_limit_answers_503_and_spares_health() -> None:
    long = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with open_app(max_concurrent_requests=2) as (http, app, slot):
        assert slot.llm is not None
        done: list[int] = []

        async def hold() -> None:
            r = await http.post("/v1/completions", json=long)
            done.append(r.status_code)

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            tg.start_soon(hold)
            with anyio.fail_after(10):
                await slot.llm.wait_statistics(lambda s: s.running == 2)
            assert app.state.limits.active == 2
            r = await http.post("/v1/completions", json={"prompt": "x"})
            message = openai_error(r, 503)
            assert "limit of 2" in message and r.headers["retry-after"] == "1"
            assert "x-request-id" in r.headers
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/metrics")).status_code == 200
            openai_error(await http.get("/v1/models"), 503)
        assert done == [200, 200]
        assert app.state.limits.active == 0 and app.state.limits.by_client == {}
        assert app.state.limits.refused == 2
        r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200


async def test_per_client_limit_leaves_other_clients_served() -> None:
    long = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
    async with open_app(max_concurrent_requests_per_client=1) as (_, app, slot):
        assert slot.llm is not None

        def client(host: str) -> httpx.AsyncClient:
            transport = httpx.ASGITransport(app=app, client=(host, 1234))
            return httpx.AsyncClient(transport=transport, base_url="http://t")

        async with client("10.0.0.1") as a, client("10.0.0.2") as b:
            statuses: list[int] = []

            async def hold() -> None:
                statuses.append(
                    (await a.post("/v1/completions", json=long)).status_code
                )

            async with anyio.create_task_group() as tg:
                tg.start_soon(hold)
                with anyio.fail_after(10):
                    await slot.llm.wait_statistics(lambda s: s.running == 1)
                r = await a.post("/v1/completions", json={"prompt": "x"})
                assert "this client" in openai_error(r, 503)
                r = await b.post(
                    "/v1/completions", json={"prompt": "x", "max_tokens": 1}
                )
                assert r.status_code == 200
            assert statuses == [200]
            assert app.state.limits.by_client == {}


# -- failures: a bug's 500, clients that hang up mid-body --------------------------


async def test_a_bugs_500_carries_the_request_id(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from structllm.server.tokenize.serving import TokenizeServing

    async def broken(self: Any, body: Any, big: bool) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(TokenizeServing, "tokenize", broken)
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    slot = EngineSlot()
    app = build_app(slot, ServerConfig(model_name="tiny-random"))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        r = await http.post(
            "/tokenize", json={"prompt": "x"}, headers={"X-Request-Id": "bug-1"}
        )
    assert "RuntimeError" in openai_error(r, 500)
    assert r.headers["x-request-id"] == "bug-1"
    (line,) = access_lines(caplog)
    assert (line["request_id"], line["status"]) == ("bug-1", 500)


async def test_clients_hanging_up_mid_body_leave_the_server_serving() -> None:
    """Under trio, hypercorn let such a hang-up's BusyResourceError stop the
    whole server (tools/soak.py found it); now only that connection ends."""
    body = json.dumps({"prompt": "x" * 200, "max_tokens": 2}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    head = request.index(b"\r\n\r\n") + 4
    async with open_server() as s, open_socket_server(s) as url:
        port = int(url.rsplit(":", 1)[1])

        async def hang_up(cut: int) -> None:
            async with await anyio.connect_tcp("127.0.0.1", port) as conn:
                await conn.send(request[:cut])

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(100):
                    tg.start_soon(hang_up, head + 1 + (i * 7) % (len(body) - 1))
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                assert (await http.get("/health")).status_code == 200
                r = await http.post("/v1/completions", json={"prompt": "x"})
                assert r.status_code == 200
        await s.wait_idle()
