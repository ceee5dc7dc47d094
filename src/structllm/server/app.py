"""The FastAPI application: OpenAI endpoints, /health, /metrics.

Every request runs inside a task group that also watches the connection:
when the client goes away (streaming or not) the group is cancelled, the
request's stream block exits and the engine aborts it within one step.
Streaming responses are a small ASGI response of our own for that reason
(it owns the watcher), rather than Starlette's StreamingResponse.

The request body is read with a size cap and a deadline, parsed as strict
JSON (no NaN, bounded depth) and validated by the models of
:mod:`structllm.server.protocol` before anything else sees it. Every status
the server sends carries an OpenAI error body, including 404, 405, 413 and
500. Long prompts are tokenised in a worker thread, after a byte cap.

A :class:`Drain` in front of the ``/v1/`` routes implements graceful
shutdown: while draining, new requests get 503 (the listener stays open);
requests still running when the grace period ends are cut, a streaming one
with a final error event and ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import attrs
from anyio.streams.memory import MemoryObjectSendStream
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from structllm.engine.async_llm import AsyncLLM
from structllm.engine.inputs import (
    OFF_LOOP_CHARS,
    Prompt,
    check_prompt_bytes,
    parse_prompt_off_loop,
)
from structllm.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
)
from structllm.outputs import RequestOutput
from structllm.params import SamplingParams
from structllm.server import protocol as oai
from structllm.server.metrics import Metrics

__all__ = ["Drain", "EngineSlot", "ServerConfig", "build_app", "error_json"]

Emit = Callable[[dict[str, Any] | str], Awaitable[None]]


@attrs.frozen(kw_only=True)
class ServerConfig:
    model_name: str
    #: seconds before a request is ended with a timeout error; None = never
    request_timeout: float | None = None
    retry_after: int = 1
    default_max_tokens: int = 16
    #: larger request bodies are refused with 413 before being read
    max_body_bytes: int = 32 << 20
    #: a body not fully received within this many seconds gets 408
    body_timeout: float = 30.0


class _Timeout(Exception):
    pass


class EngineLoadingError(Exception):
    """The server is up but the engine has not finished loading."""


class ShuttingDownError(Exception):
    """The server is draining before it stops."""


@attrs.define(eq=False)
class EngineSlot:
    """Holds the engine once it is up: the server listens while it loads."""

    llm: AsyncLLM | None = None

    def get(self) -> AsyncLLM:
        if self.llm is None:
            raise EngineLoadingError("the engine is loading")
        return self.llm


_STATUS_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    422: "BadRequestError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_json(status: int, message: str, param: str | None = None) -> bytes:
    """An OpenAI error body, ASCII-only (so no string can fail to encode)."""
    body = oai.error_body(
        message,
        type_=_STATUS_TYPES.get(status, "APIError"),
        param=param,
        code=status,
    )
    return json.dumps(body, ensure_ascii=True).encode()


class _JSON(JSONResponse):
    """JSONResponse that escapes non-ASCII: rendering can never raise."""

    def render(self, content: Any) -> bytes:
        return json.dumps(
            content, ensure_ascii=True, allow_nan=False, separators=(",", ":")
        ).encode()


def _error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    return Response(
        error_json(status, message, param),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


@attrs.define(eq=False)
class Drain:
    """Graceful shutdown of the ``/v1/`` routes (an ASGI middleware's state).

    ``start()``: new requests get 503, the listener stays open. ``cut()``:
    requests still running are cancelled; one that already sent its 200
    gets a final error event and ``[DONE]``, one that did not gets a 503.
    """

    retry_after: int = 1
    draining: bool = False
    cutting: bool = False
    _scopes: set[anyio.CancelScope] = attrs.Factory(set)
    _idle: anyio.Event | None = None

    @property
    def active(self) -> int:
        return len(self._scopes)

    def start(self) -> None:
        self.draining = True

    def cut(self) -> None:
        self.cutting = True
        for scope in list(self._scopes):
            scope.cancel()

    async def wait_idle(self) -> None:
        while self._scopes:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    @contextlib.contextmanager
    def _register(self) -> Iterator[anyio.CancelScope]:
        scope = anyio.CancelScope()
        self._scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._scopes.discard(scope)
            if not self._scopes and self._idle is not None:
                self._idle.set()
                self._idle = None

    def middleware(self, app: ASGIApp) -> ASGIApp:
        async def drained(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
                await app(scope, receive, send)
                return
            if self.draining:
                await _send_error(
                    send,
                    503,
                    "the server is shutting down",
                    {"retry-after": str(self.retry_after), "connection": "close"},
                )
                return
            started: dict[str, Any] = {}
            finished = False

            async def tracked(message: Message) -> None:
                nonlocal finished
                if message["type"] == "http.response.start":
                    started.update(message)
                elif message["type"] == "http.response.body" and not message.get(
                    "more_body", False
                ):
                    finished = True
                await send(message)

            with self._register() as cancel:
                await app(scope, receive, tracked)
            if not cancel.cancelled_caught or finished:
                return
            with contextlib.suppress(OSError, RuntimeError):
                if not started:
                    await _send_error(send, 503, "the server is shutting down")
                elif _is_event_stream(started):
                    tail = (
                        "data: "
                        + error_json(
                            503, "the server shut down before the response finished"
                        ).decode()
                    )
                    await send(
                        {
                            "type": "http.response.body",
                            "body": f"{tail}\n\ndata: [DONE]\n\n".encode(),
                            "more_body": False,
                        }
                    )
                else:
                    await send(
                        {"type": "http.response.body", "body": b"", "more_body": False}
                    )

        return drained


def _is_event_stream(start: dict[str, Any]) -> bool:
    return any(
        k.lower() == b"content-type" and v.startswith(b"text/event-stream")
        for k, v in start.get("headers", [])
    )


async def _send_error(
    send: Send, status: int, message: str, headers: dict[str, str] | None = None
) -> None:
    body = error_json(status, message)
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.encode(), v.encode()) for k, v in (headers or {}).items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class EventStream(Response):
    """Server-sent events from ``produce(emit)``, cancelled if the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, produce: Callable[[Emit], Awaitable[None]]) -> None:
        super().__init__(status_code=200, media_type=self.media_type)
        self._produce = produce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                ],
            }
        )

        async def emit(event: dict[str, Any] | str) -> None:
            data = event if isinstance(event, str) else json.dumps(event)
            await send(
                {
                    "type": "http.response.body",
                    "body": f"data: {data}\n\n".encode(),
                    "more_body": True,
                }
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
            await self._produce(emit)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            tg.cancel_scope.cancel()


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


class _TooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing more than ``limit`` bytes (run it under a deadline)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


#: bodies larger than this are parsed and validated in a worker thread
_BIG_BODY = 256 << 10

_T = TypeVar("_T")


async def _maybe_off_loop(big: bool, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, in a worker thread when ``big`` (the loop stays responsive).

    Cancelled meanwhile, it waits for the thread (CPU work bounded by the
    body cap) and then raises; the thread's result is dropped.
    """
    if not big:
        return fn(*args)
    result = await anyio.to_thread.run_sync(fn, *args)
    await anyio.lowlevel.checkpoint_if_cancelled()
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_json(raw: bytes) -> Any:
    return json.loads(raw, parse_constant=_reject_constant)


_M = TypeVar("_M", bound=BaseModel)


def _validate(model: type[_M], body: Any) -> _M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise oai.validation_error(exc) from None


@attrs.frozen(kw_only=True)
class _Shape:
    """How one request's responses look."""

    chat: bool
    stream: bool
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False
    #: chat: text the assistant's message starts with (vLLM's chat echo)
    echo_text: str = ""
    top_logprobs: int = 0
    return_token_ids: bool = False
    as_ids: bool = False


@attrs.frozen
class _Job:
    """One choice to generate: choice ``index`` of prompt ``prompt_index``."""

    index: int
    prompt_index: int
    prompt: Prompt
    params: SamplingParams


def build_app(
    slot: EngineSlot, config: ServerConfig, drain: Drain | None = None
) -> FastAPI:
    drain = drain or Drain(retry_after=config.retry_after)
    app = FastAPI(title="structllm", docs_url=None, redoc_url=None)
    app.add_middleware(_DrainMiddleware, drain=drain)
    created = oai.now()
    fingerprint = oai.fingerprint("structllm", config.model_name)

    def gauges() -> dict[str, tuple[str, float]]:
        if slot.llm is None:
            return {"engine_healthy": ("1 when the engine serves, else 0.", 0.0)}
        s = slot.llm.statistics()
        usage = s.blocks_used / s.num_blocks if s.num_blocks else 0.0
        return {
            "num_requests_running": ("Requests in the running batch.", s.running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", s.waiting),
            "kv_cache_usage_perc": ("Fraction of KV-cache blocks in use.", usage),
            "num_preemptions_total": ("Preemptions since start.", s.total_preemptions),
            "engine_restarts_total": ("Worker restarts since start.", s.restarts),
            "engine_healthy": ("1 when the engine serves, else 0.", float(s.healthy)),
        }

    metrics = Metrics(gauges)
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    app.state.metrics = metrics
    app.state.drain = drain

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.url.path!r}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path!r}"
        return _error(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return _error(400, f"invalid request: {exc.errors()[:1]}")

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        return _error(500, f"internal error: {type(exc).__name__}")

    def check_model(name: str | None) -> None:
        if name and name != config.model_name:
            raise _NotFound(
                f"the model {name!r} does not exist; this server serves "
                f"{config.model_name!r}"
            )

    async def guarded(
        request: Request, handler: Callable[[Any, bool], Awaitable[Response]]
    ) -> Response:
        """Errors -> OpenAI error bodies; a disconnect cancels the handler.

        The body is read first: afterwards the only message left to receive
        is the disconnect, which a watcher task waits for.
        """
        try:
            with anyio.fail_after(config.body_timeout):
                raw = await _read_body(request, config.max_body_bytes)
        except ClientDisconnect:
            return Response(status_code=499)
        except _TooLarge:
            return _error(
                413,
                f"the request body exceeds {config.max_body_bytes} bytes",
                headers={"connection": "close"},
            )
        except TimeoutError:
            return _error(
                408,
                f"the request body was not received within {config.body_timeout:g}s",
                headers={"connection": "close"},
            )
        big = len(raw) > _BIG_BODY
        try:
            body = await _maybe_off_loop(big, _parse_json, raw)
        except (ValueError, RecursionError) as exc:
            return _error(400, f"the body is not valid JSON: {exc}"[:500])
        try:
            response = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_on_disconnect, request.receive, tg.cancel_scope)
                with _deadline(config.request_timeout):
                    response = await handler(body, big)
                tg.cancel_scope.cancel()
            if response is None:  # the client went away
                return Response(status_code=499)
            return response
        except BaseExceptionGroup as group:
            response = _error_response(_leaf(group))
            if response is None:
                raise
            return response

    def _error_response(exc: BaseException) -> Response | None:
        if isinstance(exc, InvalidRequestError):
            return _error(400, str(exc), param=exc.field)
        if isinstance(exc, _NotFound):
            return _error(404, str(exc), param="model")
        if isinstance(exc, EngineOverloadedError | EngineLoadingError):
            return _error(
                503, str(exc), headers={"Retry-After": str(config.retry_after)}
            )
        if isinstance(exc, EngineDeadError):
            return _error(503, f"the engine is unavailable: {exc}")
        if isinstance(exc, _Timeout):
            return _error(
                408, f"the request took longer than {config.request_timeout:g}s"
            )
        if isinstance(exc, RequestFailedError):
            return _error(500, str(exc))
        return None

    @app.get("/health")
    async def health() -> Response:
        if slot.llm is None or drain.draining:
            return Response(status_code=503)  # loading, or shutting down
        return Response(status_code=200 if slot.llm.statistics().healthy else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(
            metrics.render(), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models")
    async def models() -> Response:
        if slot.llm is None:
            return _error(
                503,
                "the engine is loading",
                headers={"Retry-After": str(config.retry_after)},
            )
        llm = slot.llm
        return _JSON(
            {
                "object": "list",
                "data": [
                    {
                        "id": config.model_name,
                        "object": "model",
                        "created": created,
                        "owned_by": "structllm",
                        "max_model_len": llm.max_model_len,
                    }
                ],
            }
        )

    def check_length(
        llm: AsyncLLM, ids: Sequence[int], max_tokens: int | None, field: str
    ) -> None:
        room = llm.max_model_len - len(ids)
        if max_tokens is not None and max_tokens > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {llm.max_model_len} "
                f"tokens; the prompt has {len(ids)} and {field}={max_tokens} "
                f"would need {len(ids) + max_tokens}",
                field=field,
            )

    @app.post(
        "/v1/completions",
        openapi_extra=_body_schema(oai.CompletionRequest),
        response_model=None,
    )
    async def completions(request: Request) -> Response:
        async def handle(body: Any, big: bool) -> Response:
            llm = slot.get()  # 503 while loading, before anything streams
            req = await _maybe_off_loop(big, _validate, oai.CompletionRequest, body)
            check_model(req.model)
            params = req.to_sampling_params(config.default_max_tokens)
            prompts = []
            for p in req.prompt:
                if isinstance(p, str):
                    prompt = await parse_prompt_off_loop(
                        p, llm.tokenizer, max_bytes=llm.max_prompt_bytes
                    )
                else:
                    prompt = Prompt(None, p)
                check_length(llm, prompt.token_ids, req.max_tokens, "max_tokens")
                prompts.append(prompt)
            jobs = [
                _Job(i * req.choices + j, i, p, oai.choice_seed(params, j))
                for i, p in enumerate(prompts)
                for j in range(req.choices)
            ]
            shape = _Shape(
                chat=False,
                stream=bool(req.stream),
                include_usage=req.include_usage,
                continuous_usage=req.continuous_usage,
                echo=bool(req.echo),
                return_token_ids=bool(req.return_token_ids),
                as_ids=bool(req.return_tokens_as_token_ids),
            )
            return await _run(llm, jobs, "cmpl", shape)

        return await guarded(request, handle)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=_body_schema(oai.ChatRequest),
        response_model=None,
    )
    async def chat(request: Request) -> Response:
        async def handle(body: Any, big: bool) -> Response:
            llm = slot.get()
            req = await _maybe_off_loop(big, _validate, oai.ChatRequest, body)
            check_model(req.model)
            params = req.to_sampling_params(None)
            messages = req.template_messages()
            size = sum(len(m["content"]) for m in messages)
            cap = llm.max_prompt_bytes
            if cap is not None and 4 * size > cap:  # 4: the most bytes per char
                text = "".join(m["content"] for m in messages)
                check_prompt_bytes(text, cap, field="messages")
            add_generation_prompt = req.add_generation_prompt is not False

            def render() -> tuple[str, tuple[int, ...]]:
                text = llm.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt
                )
                # the template writes BOS itself: tokenise without special tokens
                return text, tuple(llm.tokenizer.encode(text, add_special_tokens=False))

            text, ids = await _maybe_off_loop(size > OFF_LOOP_CHARS, render)
            prompt = Prompt(text, ids)
            limit = req.max_completion_tokens or req.max_tokens
            check_length(llm, ids, limit, req.limit_field)
            jobs = [
                _Job(j, 0, prompt, oai.choice_seed(params, j))
                for j in range(req.choices)
            ]
            shape = _Shape(
                chat=True,
                stream=bool(req.stream),
                include_usage=req.include_usage,
                continuous_usage=req.continuous_usage,
                echo_text=req.echo_text,
                top_logprobs=params.logprobs or 0,
                return_token_ids=bool(req.return_token_ids),
                as_ids=bool(req.return_tokens_as_token_ids),
            )
            return await _run(llm, jobs, "chatcmpl", shape)

        return await guarded(request, handle)

    def _prompt_tokens(jobs: list[_Job]) -> int:
        """Prompt tokens counted once per prompt (its n choices share it)."""
        seen = {job.prompt_index: len(job.prompt.token_ids) for job in jobs}
        return sum(seen.values())

    def _choice(job: _Job, out: RequestOutput, shape: _Shape) -> dict[str, Any]:
        """A non-streaming choice."""
        c = out.outputs[0]
        choice: dict[str, Any] = {"index": job.index}
        if shape.chat:
            choice["message"] = {
                "role": "assistant",
                "content": shape.echo_text + c.text,
            }
            choice["logprobs"] = oai.chat_logprobs(
                c, shape.top_logprobs, as_ids=shape.as_ids
            )
        else:
            choice["text"] = (
                (_prompt_text(job.prompt) + c.text) if shape.echo else (c.text)
            )
            choice["logprobs"] = oai.completion_logprobs(c, as_ids=shape.as_ids)
        choice["finish_reason"] = c.finish_reason
        choice["stop_reason"] = c.stop_reason
        if shape.return_token_ids:
            if not shape.chat:
                choice["prompt_token_ids"] = list(job.prompt.token_ids)
            choice["token_ids"] = list(c.token_ids)
        return choice

    async def _run(
        llm: AsyncLLM, jobs: list[_Job], prefix: str, shape: _Shape
    ) -> Response:
        rid = oai.new_id(prefix)
        obj = "chat.completion" if shape.chat else "text_completion"
        prompt_tokens = _prompt_tokens(jobs)
        if not shape.stream:
            finals: dict[int, RequestOutput] = {}

            async def one(job: _Job) -> None:
                finals[job.index] = await _observed(job.prompt, job.params, None)

            async with anyio.create_task_group() as tg:
                for job in jobs:
                    tg.start_soon(one, job)
            by_index = {job.index: job for job in jobs}
            choices = [_choice(by_index[i], finals[i], shape) for i in sorted(finals)]
            completion_tokens = sum(
                len(f.outputs[0].token_ids) for f in finals.values()
            )
            body: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": oai.now(),
                "model": config.model_name,
                "system_fingerprint": fingerprint,
                "choices": choices,
                "usage": oai.usage(
                    prompt_tokens,
                    completion_tokens,
                    sum(f.num_cached_tokens or 0 for f in finals.values()),
                ),
            }
            if shape.chat and shape.return_token_ids:
                body["prompt_token_ids"] = list(jobs[0].prompt.token_ids)
            return _JSON(body)

        async def produce(emit: Emit) -> None:
            chunk_obj = "chat.completion.chunk" if shape.chat else "text_completion"
            send, receive = anyio.create_memory_object_stream[dict[str, Any]](math.inf)
            generated: dict[int, int] = {job.index: 0 for job in jobs}
            cached: dict[int, int] = {job.index: 0 for job in jobs}

            def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
                event: dict[str, Any] = {
                    "id": rid,
                    "object": chunk_obj,
                    "created": oai.now(),
                    "model": config.model_name,
                    "system_fingerprint": fingerprint,
                    "choices": choices,
                }
                if shape.continuous_usage:
                    event["usage"] = oai.usage(
                        prompt_tokens, sum(generated.values()), sum(cached.values())
                    )
                return event

            async def one(
                out_channel: MemoryObjectSendStream[dict[str, Any]], job: _Job
            ) -> None:
                index = job.index
                with out_channel:
                    first: dict[str, Any] = {
                        "index": index,
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    if shape.chat:
                        first["delta"] = {
                            "role": "assistant",
                            "content": shape.echo_text,
                        }
                    elif shape.echo:
                        first["text"] = _prompt_text(job.prompt)
                    if shape.return_token_ids and not shape.chat:
                        first["prompt_token_ids"] = list(job.prompt.token_ids)
                    if shape.chat or shape.echo or shape.return_token_ids:
                        event = chunk([first])
                        if shape.chat and shape.return_token_ids and index == 0:
                            event["prompt_token_ids"] = list(job.prompt.token_ids)
                        out_channel.send_nowait(event)

                    def on_output(out: RequestOutput) -> None:
                        c = out.outputs[0]
                        generated[index] = out.num_generated_tokens
                        cached[index] = out.num_cached_tokens or 0
                        choice: dict[str, Any] = {"index": index}
                        if shape.chat:
                            choice["delta"] = (
                                {"content": c.text}
                                if c.text or not c.finish_reason
                                else {}
                            )
                            choice["logprobs"] = oai.chat_logprobs(
                                c, shape.top_logprobs, as_ids=shape.as_ids
                            )
                        else:
                            choice["text"] = c.text
                            choice["logprobs"] = oai.completion_logprobs(
                                c, as_ids=shape.as_ids
                            )
                        choice["finish_reason"] = c.finish_reason
                        if shape.return_token_ids:
                            choice["token_ids"] = list(c.token_ids)
                        if c.finish_reason is not None:
                            choice["stop_reason"] = c.stop_reason
                        out_channel.send_nowait(chunk([choice]))

                    await _observed(job.prompt, job.params, on_output)

            try:
                async with anyio.create_task_group() as tg:
                    with send:
                        for job in jobs:
                            tg.start_soon(one, send.clone(), job)
                    async for event in receive:
                        await emit(event)
            except BaseExceptionGroup as group:
                response = _error_response(_leaf(group))
                if response is None:
                    raise
                await emit(json.loads(bytes(response.body)))
            else:
                if shape.include_usage:
                    event = chunk([])
                    event["usage"] = oai.usage(
                        prompt_tokens, sum(generated.values()), sum(cached.values())
                    )
                    await emit(event)
            await emit("[DONE]")

        async def produce_with_deadline(emit: Emit) -> None:
            try:
                with _deadline(config.request_timeout):
                    await produce(emit)
            except _Timeout:  # the 200 is sent: report in the stream
                response = _error_response(_Timeout())
                assert response is not None
                await emit(json.loads(bytes(response.body)))
                await emit("[DONE]")

        # Refuse what we can before promising a 200: a bad prompt is a 400
        # and overload a 503, streaming or not.
        for prompt in {job.prompt_index: job.prompt for job in jobs}.values():
            llm.check_admission(
                prompt.token_ids, count=len(jobs), params=jobs[0].params
            )
        return EventStream(produce_with_deadline)

    def _prompt_text(prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return slot.get().tokenizer.decode(list(prompt.token_ids))

    async def _observed(
        prompt: Prompt,
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None] | None,
    ) -> RequestOutput:
        """Run one request, recording latency metrics; return its final output."""
        start = time.monotonic()
        last = start
        first = True
        given: dict[str, Any] = {"prompt_token_ids": list(prompt.token_ids)}
        if prompt.text is not None:
            given["prompt"] = prompt.text
        s = slot.get().stream(given, params)
        try:
            async with s:
                async for out in s:
                    now = time.monotonic()
                    if first:
                        metrics.ttft.observe(now - start)
                        first = False
                    else:
                        metrics.itl.observe(now - last)
                    last = now
                    if on_output is not None:
                        on_output(out)
        finally:
            # also when cancelled (client gone, timeout): synchronous, no await
            result = s.final_output
            if result is not None:
                metrics.e2e.observe(time.monotonic() - start)
                if result.queue_time is not None:
                    metrics.queue.observe(result.queue_time)
                metrics.requests.inc(finished_reason=str(result.finish_reason))
                metrics.prompt_tokens.inc(len(result.prompt_token_ids))
                metrics.generation_tokens.inc(len(result.token_ids))
        assert result is not None
        return result

    return app


class _DrainMiddleware:
    """Starlette-style middleware class around :meth:`Drain.middleware`."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self._app = drain.middleware(app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


class _NotFound(Exception):
    pass


_SCHEMA_DEFS: dict[str, Any] = {}


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The request body's JSON schema for the OpenAPI document.

    Nested models go to ``components/schemas`` (see :func:`_openapi`).
    """
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    _SCHEMA_DEFS.update(schema.pop("$defs", {}))
    _SCHEMA_DEFS[model.__name__] = schema
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ref}},
        }
    }


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(
                _SCHEMA_DEFS
            )
            app.openapi_schema = doc
        return app.openapi_schema

    return openapi


def _leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    """The first leaf exception of a (nested) group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class _deadline:
    """``fail_after`` that raises our _Timeout (distinct from other timeouts)."""

    def __init__(self, seconds: float | None) -> None:
        self._scope = anyio.CancelScope(
            deadline=math.inf if seconds is None else anyio.current_time() + seconds
        )

    def __enter__(self) -> anyio.CancelScope:
        return self._scope.__enter__()

    def __exit__(self, *exc: Any) -> bool:
        swallowed = self._scope.__exit__(*exc)
        deadline = self._scope.deadline
        if (
            self._scope.cancelled_caught
            and anyio.current_time() >= deadline != math.inf
        ):
            raise _Timeout
        return bool(swallowed)
