"""HTTP/1.0 clients on a real socket: whole answers on both loops.

An HTTP/1.0 POST without ``Content-Length`` has an empty body (RFC 1945,
h11); bytes sent after its head are not a request, and hypercorn answers
them with a 400 of its own (OpenAI-shaped: ``server/run.py``). Under trio
that 400's body was lost (Content-Length 103, 0 bytes: issue 33) while the
app answered the request h11 had parsed; ``_openai_error_bodies`` now writes
the error in one piece. The server runs on hypercorn in this process under
the test's own loop, as ``structllm serve`` runs it.
"""

from __future__ import annotations

import json

import anyio
import pytest

from tests.test_server_app import open_server, open_socket_server

pytestmark = pytest.mark.anyio


async def exchange(url: str, raw: bytes) -> tuple[bytes, bytes]:
    """Send ``raw`` on a fresh connection; the head and body read to EOF."""
    port = int(url.rsplit(":", 1)[1])
    received = b""
    with anyio.fail_after(20):
        async with await anyio.connect_tcp("127.0.0.1", port) as conn:
            await conn.send(raw)
            while True:
                try:
                    received += await conn.receive()
                except anyio.EndOfStream:
                    break
    head, _, body = received.partition(b"\r\n\r\n")
    return head, body


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    raise AssertionError(f"no Content-Length in {head!r}")


async def test_body_without_content_length_gets_a_whole_400() -> None:
    async with open_server() as s, open_socket_server(s) as url:
        for _ in range(5):  # it was lost every time under trio
            head, body = await exchange(
                url,
                b"POST /v1/completions HTTP/1.0\r\nHost: t\r\n"
                b"Content-Type: application/json\r\n\r\n"
                b'{"prompt": "hi", "max_tokens": 2}',
            )
            assert head.startswith(b"HTTP/1.1 400"), head
            assert len(body) == content_length(head)
            error = json.loads(body)["error"]
            assert error["code"] == 400 and error["type"] == "BadRequestError"


async def test_http10_without_a_body_and_with_content_length() -> None:
    async with open_server() as s, open_socket_server(s) as url:
        head, body = await exchange(
            url, b"POST /v1/completions HTTP/1.0\r\nHost: t\r\n\r\n"
        )
        assert head.startswith(b"HTTP/1.1 400") and len(body) == content_length(head)
        assert "not valid JSON" in json.loads(body)["error"]["message"]
        payload = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        head, body = await exchange(
            url,
            b"POST /v1/completions HTTP/1.0\r\nHost: t\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload,
        )
        assert head.startswith(b"HTTP/1.1 200") and len(body) == content_length(head)
        assert json.loads(body)["usage"]["completion_tokens"] == 2
        head, body = await exchange(url, b"GET /health HTTP/1.0\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
