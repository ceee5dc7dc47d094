"""API keys: the matrix of routes and credentials, in process and on sockets.

In process through ``httpx.ASGITransport`` (both AnyIO backends), then the
same app on hypercorn behind a loopback socket under each loop, then
``structllm serve`` itself per loop with a key from the flag and one from
``STRUCTLLM_API_KEY``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from structllm.cli import build_parser, engine_args
from structllm.config import EngineConfig, ServerConfig
from structllm.server.http import security
from structllm.server.http.access import ACCESS_LOGGER
from structllm.server.http.security import API_KEY_ENV, ApiKeyMiddleware, api_keys
from structllm.server.run import configs_from_args
from structllm.testing.sse import DONE, adata_events
from tests.test_server_app import events, open_server, open_socket_server
from tests.test_server_ops import openai_error

KEYS = ("sk-first-0123456789", "sk-second-abcdef")
CHAT = [{"role": "user", "content": "hi"}]

#: (method, path, body) of every route behind the key
PROTECTED: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 2, "stream": True},
    ),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny-random", None),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [104, 105]}),
]

#: credentials that are refused (the header's value, or None for no header)
REFUSED: list[str | None] = [
    None,
    "",
    "Bearer",
    "Bearer ",
    f"Basic {KEYS[0]}",
    f"Token {KEYS[0]}",
    f"{KEYS[0]}",
    "Bearer sk-wrong",
    f"Bearer {KEYS[0][:-1]}",
    f"Bearer {KEYS[0]}x",
    f"Bearer {KEYS[0].upper()}",
    f"Bearer {KEYS[0]},{KEYS[1]}",
]
ACCEPTED = [f"Bearer {KEYS[0]}", f"bearer {KEYS[1]}", f"Bearer  {KEYS[0]} "]


def headers(auth: str | None) -> dict[str, str]:
    return {} if auth is None else {"Authorization": auth}


def check_refused(r: httpx.Response) -> None:
    message = openai_error(r, 401)
    assert r.headers["www-authenticate"] == "Bearer"
    assert "x-request-id" in r.headers
    assert not any(k in message or k in str(r.headers) for k in KEYS)


def check_served(r: httpx.Response, method: str, path: str, body: Any) -> None:
    assert r.status_code == 200, (path, r.text)
    if body and body.get("stream"):
        assert events(r.text)[-1] == "[DONE]"
    else:
        assert "error" not in r.json()


# -- in process -------------------------------------------------------------------


@pytest.mark.anyio
async def test_auth_matrix_in_process() -> None:
    async with open_server(api_key=KEYS) as s:
        for method, path, body in PROTECTED:
            for auth in REFUSED:
                r = await s.http.request(method, path, json=body, headers=headers(auth))
                check_refused(r)
            for auth in ACCEPTED:
                r = await s.http.request(method, path, json=body, headers=headers(auth))
                check_served(r, method, path, body)
        # open whatever the credentials
        for auth in (None, "Bearer sk-wrong"):
            assert (
                await s.http.get("/health", headers=headers(auth))
            ).status_code == 200
            r = await s.http.get("/version", headers=headers(auth))
            assert r.status_code == 200
            r = await s.http.get("/metrics", headers=headers(auth))
            assert r.status_code == 200 and "structllm_" in r.text
        # unknown paths are 404 with or without a key; /v1/... needs one
        openai_error(await s.http.get("/nope"), 404)
        check_refused(await s.http.get("/v1/nope"))
        r = await s.http.get("/v1/nope", headers=headers(ACCEPTED[0]))
        openai_error(r, 404)
        await s.wait_idle()


@pytest.mark.anyio
async def test_metrics_require_auth() -> None:
    async with open_server(api_key=KEYS, metrics_require_auth=True) as s:
        check_refused(await s.http.get("/metrics"))
        check_refused(await s.http.get("/metrics", headers=headers("Bearer no")))
        r = await s.http.get("/metrics", headers=headers(ACCEPTED[0]))
        assert r.status_code == 200 and "structllm_" in r.text
        assert (await s.http.get("/health")).status_code == 200
        assert (await s.http.get("/version")).status_code == 200


@pytest.mark.anyio
async def test_no_key_configured_is_an_open_server() -> None:
    async with open_server() as s:
        for method, path, body in PROTECTED:
            for auth in (None, "Bearer anything", "Basic x"):
                r = await s.http.request(method, path, json=body, headers=headers(auth))
                check_served(r, method, path, body)


@pytest.mark.anyio
async def test_keys_never_reach_logs_or_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, the access log included
    secret = "sk-very-secret-value-42"
    async with open_server(api_key=(secret,), max_log_len=1000) as s:
        for auth in (f"Bearer {secret}", f"Bearer {secret}-wrong", f"Basic {secret}"):
            r = await s.http.post(
                "/v1/completions",
                json={"prompt": "hello", "max_tokens": 2},
                headers=headers(auth),
            )
            assert secret not in r.text and secret not in str(r.headers)
        lines = [r for r in caplog.records if r.name == ACCESS_LOGGER]
        assert [json.loads(r.getMessage())["status"] for r in lines] == [200, 401, 401]
        assert "hello" in caplog.text  # the prompt is logged: --max-log-len
    assert secret not in caplog.text
    config = ServerConfig(model_name="m", api_key=(secret,))
    assert secret not in repr(config)
    with pytest.raises(ValueError, match="printable ASCII") as info:
        ServerConfig(model_name="m", api_key=("secret with space",))
    assert "secret with space" not in str(info.value)


async def no_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("not reached")


def test_key_comparison_looks_at_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", counting)
    keys = ("k1", "k2", "k3")
    middleware = ApiKeyMiddleware(no_app, keys=keys, metrics_require_auth=False)
    for header, ok in ((b"Bearer k1", True), (b"Bearer k3", True), (b"Bearer k", False), (b"Basic k1", False)):  # fmt: skip
        calls.clear()
        assert middleware.authorized(header) is ok
        # hashed to one length first, compared with every key
        assert len(calls) == len(keys) and {len(a) for a, _ in calls} == {32}
    assert middleware.authorized(None) is False
    with pytest.raises(ValueError, match="at least one key"):
        ApiKeyMiddleware(no_app, keys=(), metrics_require_auth=False)


def test_keys_come_from_flags_and_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert api_keys(["a"], {API_KEY_ENV: " b, c,,a "}) == ("a", "b", "c")
    assert api_keys([], {}) == ()
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    ns = build_parser().parse_args(["serve", "m", "--api-key", "x", "--api-key", "y"])
    server, _ = configs_from_args(ns, EngineConfig(model="m", **engine_args(ns)))
    assert server.api_key == ("x", "y", "from-env")
    monkeypatch.delenv(API_KEY_ENV)
    ns = build_parser().parse_args(["serve", "m"])
    server, _ = configs_from_args(ns, EngineConfig(model="m", **engine_args(ns)))
    assert server.api_key == ()
    ns = build_parser().parse_args(
        ["serve", "m", "--allowed-methods", "GET", "--allowed-methods", "POST"]
    )
    server, _ = configs_from_args(ns, EngineConfig(model="m", **engine_args(ns)))
    assert server.allowed_methods == ("GET", "POST")  # replaces the default "*"
    assert server.allowed_headers == ("*",)


# -- on a socket, in this process (both loops) ------------------------------------


@pytest.mark.anyio
async def test_auth_on_a_real_socket() -> None:
    async with open_server(api_key=KEYS) as s, open_socket_server(s) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for method, path, body in PROTECTED:
                check_refused(await http.request(method, path, json=body))
                r = await http.request(
                    method, path, json=body, headers=headers(f"Bearer {KEYS[1]}")
                )
                check_served(r, method, path, body)
            body = {"prompt": "x", "max_tokens": 3, "stream": True}
            auth = {"Authorization": f"Bearer {KEYS[0]}", "X-Request-Id": "sock-1"}
            async with http.stream(
                "POST", "/v1/completions", json=body, headers=auth
            ) as r:
                assert r.headers["x-request-id"] == "sock-1"
                assert (await adata_events(r))[-1] == DONE
            assert (await http.get("/health")).status_code == 200
        await s.wait_idle()


# -- `structllm serve` (both loops) -----------------------------------------------


@contextlib.contextmanager
def serve(
    tmp_path: Path, loop: str, *args: str, env: dict[str, str]
) -> Iterator[tuple[str, Path]]:
    """``structllm serve tiny-random`` with its stderr (the access log) in a file."""
    log = tmp_path / f"stderr-{loop}.txt"
    cmd = [sys.executable, "-m", "structllm.cli", "serve", "tiny-random"]
    cmd += ["--port", "0", "--loop", loop, "--max-model-len", "256", *args]
    with log.open("w") as err:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, **env},
        )
    assert proc.stdout is not None
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited with {proc.wait()}")
            m = re.search(r"serving .* on (http://\S+)", line)
            url = m.group(1) if m else None
        assert url is not None
        yield url, log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_serve_with_keys_cors_and_access_log(tmp_path: Path, loop: str) -> None:
    flag_key, env_key = "sk-from-flag", "sk-from-env"
    args = ["--api-key", flag_key, "--metrics-require-auth"]
    args += ["--allowed-origins", "https://ui.example", "--max-log-len", "4"]
    env = {API_KEY_ENV: env_key}
    with (
        serve(tmp_path, loop, *args, env=env) as (url, log),
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        body = {"prompt": "hello", "max_tokens": 2}
        check_refused(http.post("/v1/completions", json=body))
        check_refused(http.get("/metrics"))
        for i, key in enumerate((flag_key, env_key)):
            auth = {"Authorization": f"Bearer {key}", "X-Request-Id": f"id-{i}"}
            r = http.post("/v1/completions", json=body, headers=auth)
            assert r.status_code == 200 and r.headers["x-request-id"] == f"id-{i}"
            assert http.get("/metrics", headers=auth).status_code == 200
        assert http.get("/health").status_code == 200
        preflight = {
            "Origin": "https://ui.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        }
        r = http.options("/v1/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    served = [x for x in lines if x["method"] == "POST" and x["status"] == 200]
    assert [x["request_id"] for x in served] == ["id-0", "id-1"]
    assert all(x["prompt"] == "hell" and x["completion_tokens"] == 2 for x in served)
    assert {x["status"] for x in lines} == {200, 401}
    assert [x["method"] for x in lines].count("OPTIONS") == 1
    text = log.read_text()
    assert flag_key not in text and env_key not in text
