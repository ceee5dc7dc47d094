"""The FastAPI application: OpenAI endpoints, /health, /metrics.

Every request runs inside a task group that also watches the connection:
when the client goes away (streaming or not) the group is cancelled, the
request's stream block exits and the engine aborts it within one step.
Streaming responses are a small ASGI response of our own for that reason
(it owns the watcher), rather than Starlette's StreamingResponse.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import attrs
from anyio.streams.memory import MemoryObjectSendStream
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from structllm.engine.async_llm import AsyncLLM
from structllm.engine.inputs import parse_prompt
from structllm.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
)
from structllm.outputs import RequestOutput
from structllm.params import SamplingParams
from structllm.server import protocol as oai
from structllm.server.metrics import Metrics

__all__ = ["EngineSlot", "ServerConfig", "build_app"]

Emit = Callable[[dict[str, Any] | str], Awaitable[None]]


@attrs.frozen(kw_only=True)
class ServerConfig:
    model_name: str
    #: seconds before a request is ended with a timeout error; None = never
    request_timeout: float | None = None
    retry_after: int = 1
    default_max_tokens: int = 16


class _Timeout(Exception):
    pass


class EngineLoadingError(Exception):
    """The server is up but the engine has not finished loading."""


@attrs.define(eq=False)
class EngineSlot:
    """Holds the engine once it is up: the server listens while it loads."""

    llm: AsyncLLM | None = None

    def get(self) -> AsyncLLM:
        if self.llm is None:
            raise EngineLoadingError("the engine is loading")
        return self.llm


def _error(
    status: int,
    message: str,
    *,
    type_: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        oai.error_body(message, type_=type_, param=param, code=status),
        status_code=status,
        headers=headers,
    )


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


def build_app(slot: EngineSlot, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="structllm", docs_url=None, redoc_url=None)
    created = oai.now()

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
            "engine_healthy": (
                "1 when the engine serves, else 0.",
                float(s.ready and not s.dead),
            ),
        }

    metrics = Metrics(gauges)
    app.state.metrics = metrics

    def check_model(name: str) -> JSONResponse | None:
        if name and name != config.model_name:
            return _error(
                404,
                f"the model {name!r} does not exist; this server serves "
                f"{config.model_name!r}",
                type_="NotFoundError",
                param="model",
            )
        return None

    async def guarded(
        request: Request, handler: Callable[[Any], Awaitable[Response]]
    ) -> Response:
        """Errors -> OpenAI error bodies; a disconnect cancels the handler.

        The body is read first: afterwards the only message left to receive
        is the disconnect, which a watcher task waits for.
        """
        try:
            raw = await request.body()
        except ClientDisconnect:
            return Response(status_code=499)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            return _error(
                400, f"the body is not valid JSON: {exc}", type_="BadRequestError"
            )
        try:
            response = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_on_disconnect, request.receive, tg.cancel_scope)
                with _deadline(config.request_timeout):
                    response = await handler(body)
                tg.cancel_scope.cancel()
            if response is None:  # the client went away
                return Response(status_code=499)
            return response
        except BaseExceptionGroup as group:
            response = _error_response(_leaf(group))
            if response is None:
                raise
            return response

    def _error_response(exc: BaseException) -> JSONResponse | None:
        if isinstance(exc, InvalidRequestError):
            return _error(400, str(exc), type_="BadRequestError", param=exc.field)
        if isinstance(exc, EngineOverloadedError | EngineLoadingError):
            return _error(
                503,
                str(exc),
                type_="ServiceUnavailableError",
                headers={"Retry-After": str(config.retry_after)},
            )
        if isinstance(exc, EngineDeadError):
            return _error(
                503,
                f"the engine is unavailable: {exc}",
                type_="ServiceUnavailableError",
            )
        if isinstance(exc, _Timeout):
            return _error(
                408,
                f"the request took longer than {config.request_timeout:g}s",
                type_="TimeoutError",
            )
        return None

    @app.get("/health")
    async def health() -> Response:
        if slot.llm is None:
            return Response(status_code=503)  # loading
        s = slot.llm.statistics()
        if s.ready and not s.dead:
            return Response(status_code=200)
        return Response(status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(
            metrics.render(), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models")
    async def models() -> Any:
        if slot.llm is None:
            return _error(
                503,
                "the engine is loading",
                type_="ServiceUnavailableError",
                headers={"Retry-After": str(config.retry_after)},
            )
        llm = slot.llm
        return {
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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        async def handle(body: Any) -> Response:
            slot.get()  # 503 while loading, before anything streams
            req = oai.parse_completion(
                body, default_max_tokens=config.default_max_tokens
            )
            if (bad := check_model(req.model)) is not None:
                return bad
            jobs = [
                _Job(i * req.n + j, i, p, oai.choice_seed(req.params, j))
                for i, p in enumerate(req.prompts)
                for j in range(req.n)
            ]
            return await _run(
                request,
                jobs,
                "cmpl",
                req.stream,
                req.include_usage,
                chat=False,
                echo=req.echo,
            )

        return await guarded(request, handle)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        async def handle(body: Any) -> Response:
            llm = slot.get()
            req = oai.parse_chat(body, llm.tokenizer, default_max_tokens=None)
            if (bad := check_model(req.model)) is not None:
                return bad
            # the template writes BOS itself: tokenise without special tokens
            ids = tuple(llm.tokenizer.encode(req.prompt_text, add_special_tokens=False))
            jobs = [
                _Job(j, 0, ids, oai.choice_seed(req.params, j)) for j in range(req.n)
            ]
            return await _run(
                request,
                jobs,
                "chatcmpl",
                req.stream,
                req.include_usage,
                chat=True,
                top_logprobs=req.params.logprobs or 0,
            )

        return await guarded(request, handle)

    async def _run(
        request: Request,
        jobs: list[_Job],
        prefix: str,
        stream: bool,
        include_usage: bool,
        *,
        chat: bool,
        echo: bool = False,
        top_logprobs: int = 0,
    ) -> Response:
        rid = oai.new_id(prefix)
        obj = "chat.completion" if chat else "text_completion"
        if not stream:
            finals: dict[int, RequestOutput] = {}

            async def one(job: _Job) -> None:
                finals[job.index] = await _observed(job.prompt, job.params, None)

            async with anyio.create_task_group() as tg:
                for job in jobs:
                    tg.start_soon(one, job)
            choices = []
            completion_tokens = 0
            for index in sorted(finals):
                out = finals[index]
                c = out.outputs[0]
                completion_tokens += len(c.token_ids)
                if chat:
                    choices.append(
                        {
                            "index": index,
                            "message": {"role": "assistant", "content": c.text},
                            "logprobs": oai.chat_logprobs(c, top_logprobs),
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                    )
                else:
                    text = ((out.prompt or "") + c.text) if echo else c.text
                    choices.append(
                        {
                            "index": index,
                            "text": text,
                            "logprobs": oai.completion_logprobs(c),
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                    )
            prompt_tokens = _prompt_tokens(finals, jobs)
            return JSONResponse(
                {
                    "id": rid,
                    "object": obj,
                    "created": oai.now(),
                    "model": config.model_name,
                    "choices": choices,
                    "usage": oai.usage(prompt_tokens, completion_tokens),
                }
            )

        async def produce(emit: Emit) -> None:
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            send, receive = anyio.create_memory_object_stream[dict[str, Any]](math.inf)
            finals: dict[int, RequestOutput] = {}

            def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
                return {
                    "id": rid,
                    "object": chunk_obj,
                    "created": oai.now(),
                    "model": config.model_name,
                    "choices": choices,
                }

            async def one(
                out_channel: MemoryObjectSendStream[dict[str, Any]], job: _Job
            ) -> None:
                index = job.index
                with out_channel:
                    if echo:
                        out_channel.send_nowait(
                            chunk(
                                [
                                    {
                                        "index": index,
                                        "text": _prompt_text(job.prompt),
                                        "logprobs": None,
                                        "finish_reason": None,
                                    }
                                ]
                            )
                        )
                    if chat:
                        out_channel.send_nowait(
                            chunk(
                                [
                                    {
                                        "index": index,
                                        "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None,
                                        "finish_reason": None,
                                    }
                                ]
                            )
                        )

                    def on_output(out: RequestOutput) -> None:
                        c = out.outputs[0]
                        if chat:
                            choice = {
                                "index": index,
                                "delta": {"content": c.text}
                                if c.text or not c.finish_reason
                                else {},
                                "logprobs": oai.chat_logprobs(c, top_logprobs),
                                "finish_reason": c.finish_reason,
                            }
                        else:
                            choice = {
                                "index": index,
                                "text": c.text,
                                "logprobs": oai.completion_logprobs(c),
                                "finish_reason": c.finish_reason,
                            }
                        if c.finish_reason is not None:
                            choice["stop_reason"] = c.stop_reason
                        out_channel.send_nowait(chunk([choice]))

                    finals[index] = await _observed(job.prompt, job.params, on_output)

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
                if include_usage:
                    completion_tokens = sum(
                        f.num_generated_tokens for f in finals.values()
                    )
                    event = chunk([])
                    event["usage"] = oai.usage(
                        _prompt_tokens(finals, jobs), completion_tokens
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
        llm = slot.get()
        for prompt in {job.prompt_index: job.prompt for job in jobs}.values():
            ids = parse_prompt(oai.as_prompt(prompt), llm.tokenizer).token_ids
            llm.check_admission(ids, count=len(jobs))
        return EventStream(produce_with_deadline)

    def _prompt_text(prompt: str | Sequence[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return slot.get().tokenizer.decode(list(prompt))

    async def _observed(
        prompt: Any,
        params: Any,
        on_output: Callable[[RequestOutput], None] | None,
    ) -> RequestOutput:
        """Run one request, recording latency metrics; return its final output."""
        start = time.monotonic()
        last = start
        first = True
        s = slot.get().stream(oai.as_prompt(prompt), params)
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


def _leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    """The first leaf exception of a (nested) group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


@attrs.frozen
class _Job:
    """One choice to generate: choice ``index`` of prompt ``prompt_index``."""

    index: int
    prompt_index: int
    prompt: str | tuple[int, ...]
    params: SamplingParams


def _prompt_tokens(finals: dict[int, RequestOutput], jobs: list[_Job]) -> int:
    """Prompt tokens counted once per prompt (its n choices share it)."""
    seen: dict[int, int] = {}
    for job in jobs:
        if job.index in finals:
            seen.setdefault(job.prompt_index, len(finals[job.index].prompt_token_ids))
    return sum(seen.values())


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
