"""The serving base's first half: the engine slot, the guard around every
endpoint's handler and the checks and fields the endpoints share
(:class:`ServingBase`; :class:`~structllm.server.serving.Serving` adds running
and streaming the requests of a response).

``guarded()`` takes the body through
:func:`~structllm.server.http.body.receive_json` (JSON only, under a size cap
and a deadline, strict: no NaN, bounded depth; big bodies parsed in a
worker thread), runs the endpoint's handler in a task group that also
watches the connection (a client that leaves cancels it, the request's
``stream`` block exits and the engine aborts it within one step) under
``--request-timeout``, and turns the known errors into OpenAI error
responses. A request's time limit is the least of ``--request-timeout``, its
``X-Request-Timeout`` header and its body's ``timeout``
(:meth:`ServingBase.limit`); the engine sees it as the request's deadline (it
ranks and drops work by it). :meth:`ServingBase.render_messages` is the chat
render every conversation API shares.
"""

from __future__ import annotations

import contextvars
import json
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import attrs
from fastapi import Request
from fastapi.responses import Response

from structllm.config import ServerConfig
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.frontend.inputs import OFF_LOOP_CHARS, Prompt, check_prompt_bytes
from structllm.errors import EngineLoadingError, InvalidRequestError, unwrap_group
from structllm.lora_request import LoRARequest
from structllm.outputs import RequestOutput
from structllm.server.http.body import maybe_off_loop, receive_json
from structllm.server.http.errors import ModelNotFoundError, error_response
from structllm.server.http.sse import cancel_on_disconnect, deadline
from structllm.server.jobs import Job
from structllm.server.lora.registry import LoRARegistry
from structllm.server.metrics import Metrics
from structllm.server.protocol import bodies

__all__ = ["EngineSlot", "ServingBase", "header_timeout"]


@attrs.define(eq=False)
class EngineSlot:
    """Holds the engine once it is up: the server listens while it loads."""

    llm: AsyncLLM | None = None
    #: the LoRA adapters a request's ``model`` may name (``build_app``'s)
    loras: LoRARegistry | None = None

    def get(self) -> AsyncLLM:
        if self.llm is None:
            raise EngineLoadingError("the engine is loading")
        return self.llm


@attrs.define(eq=False)
class ServingBase:
    """The engine, the configuration and the metrics every endpoint shares;
    the guard and the shared checks."""

    slot: EngineSlot
    config: ServerConfig
    metrics: Metrics
    fingerprint: str = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.fingerprint = bodies.fingerprint("structllm", self.config.model_name)

    # -- the guard -----------------------------------------------------------

    async def guarded(
        self, request: Request, handler: Callable[[Any, bool], Awaitable[Response]]
    ) -> Response:
        """Errors -> OpenAI error bodies; a disconnect cancels the handler.

        The body is read first: afterwards the only message left to receive
        is the disconnect, which a watcher task waits for.
        """
        config = self.config
        try:
            _header_timeout.set(header_timeout(request))
        except InvalidRequestError as exc:
            refused = self.error_response(exc)
            assert refused is not None  # a 400
            return refused
        body = await receive_json(request, config.max_body_bytes, config.body_timeout)
        if isinstance(body, Response):
            return body
        try:
            response = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_on_disconnect, request.receive, tg.cancel_scope)
                with deadline(self.limit(None)):
                    response = await handler(body.value, body.big)
                tg.cancel_scope.cancel()
            if response is None:  # the client went away
                return Response(status_code=499)
            return response
        except BaseExceptionGroup as group:
            response = self.error_response(unwrap_group(group))
            if response is None:
                raise
            return response

    def error_response(self, exc: BaseException) -> Response | None:
        return error_response(exc, retry_after=self.config.retry_after)

    def limit(self, timeout: float | None) -> float | None:
        """Seconds this request may take: the least of ``--request-timeout``,
        the ``X-Request-Timeout`` header and ``timeout`` (the body's)."""
        limits = [
            t
            for t in (self.config.request_timeout, _header_timeout.get(), timeout)
            if t is not None
        ]
        return min(limits) if limits else None

    # -- checks shared by the endpoints ----------------------------------------

    def check_model(self, name: str | None) -> None:
        if name and name != self.config.model_name:
            raise ModelNotFoundError(
                f"the model {name!r} does not exist; this server serves "
                f"{self.config.model_name!r}"
            )

    def check_model_or_adapter(self, name: str | None) -> LoRARequest | None:
        """:meth:`check_model`, where a LoRA adapter's name (every generation
        route) is a model too: its adapter (None: the base model)."""
        loras = self.slot.loras
        adapter = None if loras is None or not name else loras.lookup(name)
        if adapter is None:
            self.check_model(name)
        return adapter

    @staticmethod
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

    @staticmethod
    async def render_messages(
        llm: AsyncLLM,
        messages: list[dict[str, Any]],
        options: dict[str, Any],
        cache_salt: str | None = None,
    ) -> Prompt:
        """``messages`` through the chat template (``options``: the other
        keywords of ``apply_chat_template``), tokenised; every API that takes
        a conversation renders it here, so they all write the same prompt.

        The text is checked against ``--max-prompt-bytes`` first (as
        ``messages``), and a long conversation is rendered and tokenised in a
        worker thread.
        """
        size = sum(len(m["content"]) for m in messages)
        cap = llm.max_prompt_bytes
        if cap is not None and 4 * size > cap:  # 4: the most bytes per char
            text = "".join(m["content"] for m in messages)
            check_prompt_bytes(text, cap, field="messages")
        tools = options.get("tools")
        # the template writes the tools out too: count them for the thread
        rendered = size + (len(json.dumps(tools)) if tools else 0)

        def render() -> tuple[str, tuple[int, ...]]:
            text = llm.tokenizer.apply_chat_template(messages, **options)
            # the template writes BOS itself: tokenise without special tokens
            return text, tuple(llm.tokenizer.encode(text, add_special_tokens=False))

        text, ids = await maybe_off_loop(rendered > OFF_LOOP_CHARS, render)
        return Prompt(text, ids, cache_salt)

    def prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        # Special tokens spelled out, as in the echoed logprobs' pieces (the
        # text offsets index into this text) and as vLLM echoes them.
        tokenizer = self.slot.get().tokenizer
        return tokenizer.decode(list(prompt.token_ids), skip_special_tokens=False)

    @staticmethod
    def prompt_tokens(jobs: Sequence[Job]) -> int:
        """Prompt tokens counted once per prompt (its n choices share it)."""
        seen = {job.prompt_index: len(job.prompt.token_ids) for job in jobs}
        return sum(seen.values())

    def served_name(self, adapter: LoRARequest | None) -> str:
        """The ``model`` a response names: the LoRA adapter's name when the
        request ran with one (vLLM's), else the served model's."""
        return self.config.model_name if adapter is None else adapter.lora_name

    def head(self, rid: str, adapter: LoRARequest | None = None) -> dict[str, Any]:
        """The fields every response and chunk starts with (``model``:
        :meth:`served_name`)."""
        return {
            "id": rid,
            "created": bodies.now(),
            "model": self.served_name(adapter),
            "system_fingerprint": self.fingerprint,
        }

    def final_usage(
        self, jobs: Sequence[Job], finals: dict[int, RequestOutput]
    ) -> bodies.Usage:
        return bodies.usage(
            self.prompt_tokens(jobs),
            sum(len(f.outputs[0].token_ids) for f in finals.values()),
            sum(f.num_cached_tokens or 0 for f in finals.values()),
        )

    def wants_metrics(self, include_metrics: bool | None) -> bool:
        """Whether a response carries vLLM's per-request ``metrics``: with
        ``--enable-per-request-metrics``, unless the request's
        ``include_metrics`` is false; ``true`` without the flag is refused."""
        enabled = self.config.enable_per_request_metrics
        if include_metrics and not enabled:
            raise InvalidRequestError(
                "include_metrics: per-request metrics are off on this server "
                "(start it with --enable-per-request-metrics)",
                field="include_metrics",
            )
        return enabled and include_metrics is not False

    @staticmethod
    def request_metrics(jobs: Sequence[Job]) -> bodies.PerRequestMetrics | None:
        """The response's ``metrics``: its one job's timings; None for several
        (prompts or ``n``), which one set of timings cannot describe, as vLLM."""
        return jobs[0].timing.metrics() if len(jobs) == 1 else None


#: the X-Request-Timeout header's seconds, for the request being served
_header_timeout: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "structllm_header_timeout", default=None
)


def header_timeout(request: Request) -> float | None:
    """The ``X-Request-Timeout`` header: positive seconds, or None if absent."""
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequestError(
            f"X-Request-Timeout must be a positive number of seconds, not {raw!r:.40}",
            field="X-Request-Timeout",
        )
    return seconds
