"""Reading a server's SSE streams: the one client the probes share.

The bench client (:mod:`~structllm.bench.serve_client`) times chunks as they
come; the soak (``tools/soak.py``), the boundary probe
(``tests/boundary_probe.py``) and the tests only need to know how a stream
ended. They read it through these helpers:

- :func:`data_events` / :func:`adata_events` / :func:`aiter_data`: the
  ``data:`` payloads of an SSE body (lines, or an httpx response read to its
  end or as it arrives), ``"[DONE]"`` included, as text;
- :func:`request_bytes` and :func:`stream_once`: one streamed POST over a raw
  socket (no client library between the test and the server's bytes), read
  to ``data: [DONE]`` or EOF, and what it came to (``"200-done"``,
  ``"200-truncated"``, the status, ``"503-clean"``...).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpx

__all__ = [
    "DONE",
    "adata_events",
    "aiter_data",
    "data_events",
    "outcome",
    "request_bytes",
    "stream_once",
]

#: the payload of the event that ends an OpenAI stream
DONE = "[DONE]"


def data_events(lines: Iterable[str]) -> list[str]:
    """The payloads of the ``data:`` lines among ``lines`` (an SSE body's)."""
    return [line[5:].strip() for line in lines if line.startswith("data:")]


async def aiter_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of a streamed httpx response as they arrive."""
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


async def adata_events(response: httpx.Response) -> list[str]:
    """:func:`data_events` of a streamed httpx response, read to its end."""
    return [data async for data in aiter_data(response)]


def request_bytes(
    body: dict[str, Any], path: str = "/v1/completions", headers: str = ""
) -> bytes:
    """A whole HTTP/1.1 POST of ``body`` as JSON, closing the connection."""
    raw = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode()
        + b"Content-Type: application/json\r\nConnection: close\r\n"
        + headers.encode()
        + f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )


async def stream_once(
    host: str, port: int, request: bytes, give_up_after: float = 600
) -> str:
    """Send ``request`` on a fresh connection and read the answer to
    ``data: [DONE]`` (under trio, hypercorn keeps a streamed response's
    connection open despite ``Connection: close``) or to EOF; its
    :func:`outcome`, or ``"error:<type>"`` / ``"timeout"``."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request)
        await writer.drain()
        data = b""
        async with asyncio.timeout(give_up_after):
            while chunk := await reader.read(65536):
                data += chunk
                if b"data: [DONE]" in data:
                    break
        writer.close()
    except OSError as exc:  # refused, reset, ...
        return f"error:{type(exc).__name__}"
    except TimeoutError:
        return "timeout"
    return outcome(data)


def outcome(data: bytes) -> str:
    """How a raw HTTP answer ended: ``"200-done"`` (a stream to ``[DONE]``),
    ``"200-truncated"``, ``"503-clean"`` (an OpenAI error body and
    ``Retry-After``), ``"503-unclean"``, ``"closed-without-response"``, or
    the status."""
    if not data:
        return "closed-without-response"
    status = data.split(b" ", 2)[1].decode()
    if status == "200":
        return "200-done" if b"data: [DONE]" in data else "200-truncated"
    if status == "503":
        head, _, body = data.partition(b"\r\n\r\n")
        try:
            clean = "error" in json.loads(body) and b"retry-after" in head.lower()
        except ValueError:
            clean = False
        return "503-clean" if clean else "503-unclean"
    return status
