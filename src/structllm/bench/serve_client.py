"""The SSE client of ``structllm bench serve``: one streamed request, timed.

It reads any OpenAI-compatible stream (completions or chat), notes when each
chunk with text arrives, and turns every failure (HTTP status, transport,
an SSE ``error`` object, a stream without text) into a recorded error.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import attrs
import httpx

from structllm.bench.serve_results import RequestResult

if TYPE_CHECKING:
    from structllm.bench.serve import RequestSpec

__all__ = [
    "Progress",
    "discover_model",
    "discover_model_at",
    "open_client",
    "stream_request",
]


def _error_message(payload: object) -> str:
    """The human part of an OpenAI-style error body."""
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(payload)


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:  # chat
        delta = choice["delta"] or {}
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    return str(choice.get("text") or "")


@attrs.define(eq=False)
class Progress:
    """What a request has seen so far; filled in while it streams."""

    chunk_times: list[float] = attrs.Factory(list)
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    status: int | None = None
    error: str | None = None

    def result(
        self, spec: RequestSpec, send: float, end: float, timed_out: str | None
    ) -> RequestResult:
        error = timed_out or self.error
        if error is None and not self.chunk_times:
            error = "the stream carried no text"
        n = len(self.chunk_times) if self.usage_tokens is None else self.usage_tokens
        return RequestResult(
            index=spec.index,
            prompt_tokens=self.prompt_tokens or spec.prompt_len,
            max_tokens=spec.max_tokens,
            send_time=send,
            end_time=end,
            chunk_times=tuple(self.chunk_times),
            output_tokens=n,
            error=error,
            status=self.status,
        )


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    start: float,
    seen: Progress,
) -> None:
    """POST ``body`` and read its SSE stream into ``seen``; never raises."""
    try:
        async with client.stream("POST", url, json=body) as resp:
            seen.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    message = _error_message(json.loads(raw))
                except ValueError:
                    message = raw.decode(errors="replace")[:200]
                seen.error = f"HTTP {resp.status_code}: {message}"
                return
            # Read to the end even after [DONE] or an error: leaving httpx's
            # chain of async generators half-consumed leaves them to the GC.
            done = False
            async for line in resp.aiter_lines():
                now = time.perf_counter() - start
                if done or not line.startswith("data:"):
                    continue  # blank separators, ": comments", "event:" lines
                data = line[5:].strip()
                done = _read_event(data, now, seen)
    except httpx.HTTPError as exc:
        seen.error = f"{type(exc).__name__}: {exc}"


def _read_event(data: str, now: float, seen: Progress) -> bool:
    """Record one ``data:`` payload; true when the stream is over for us."""
    if data == "[DONE]":
        return True
    try:
        chunk = json.loads(data)
    except ValueError:
        chunk = None
    if not isinstance(chunk, dict):
        seen.error = f"bad SSE chunk: {data[:200]}"
        return True
    if "error" in chunk or chunk.get("object") == "error":
        seen.error = f"SSE error: {_error_message(chunk)}"
        return True
    if _chunk_text(chunk):
        seen.chunk_times.append(now)
    if usage := chunk.get("usage"):
        seen.usage_tokens = usage.get("completion_tokens")
        seen.prompt_tokens = usage.get("prompt_tokens")
    return False


def open_client() -> httpx.AsyncClient:
    """A connection per request, for every server alike: llama-server closes
    idle keep-alive connections, and a request sent on one it has just
    closed failed ("Server disconnected without sending a response", 1 of
    48 requests in half the comparisons of docs/benchmarks.md). A local
    connect costs well under a millisecond of the TTFT."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=None, limits=limits, trust_env=False)


async def discover_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model id of ``GET {url}/v1/models``."""
    resp = await client.get(f"{url}/v1/models", timeout=30.0)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{url}/v1/models lists no models")
    return str(data[0]["id"])


async def discover_model_at(url: str) -> str:
    async with open_client() as client:
        return await discover_model(client, url)
