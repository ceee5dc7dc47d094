"""``POST /v1/messages``: an Anthropic conversation through the chat template,
one answer, whole or as Anthropic's events; ``/v1/messages/count_tokens``.

A request is validated as a
:class:`~structllm.server.messages.protocol.MessagesRequest`, its
conversation rendered with the model's chat template exactly as chat
completions renders the same conversation (so with greedy sampling both
routes answer alike), and it becomes one engine request. Tool calls are
found in the answer by the parser chat uses for the same ``tool_choice``
(:mod:`~structllm.text.tool_parser`); a forced call is held to a grammar.
With a reasoning parser (``--reasoning-parser``, as chat's), the thinking is
split off first and comes back as a ``thinking`` block before the answer's
blocks (streamed: ``thinking_delta`` events and an empty ``signature_delta``);
``thinking: {"type": "enabled"}`` needs one, and is refused by name without.
Every error these routes send is Anthropic's shape
(``{"type": "error", "error": {...}}``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.frontend.inputs import Prompt
from structllm.errors import InvalidRequestError, unwrap_group
from structllm.outputs import CompletionOutput, RequestOutput
from structllm.server.chat import reasoning
from structllm.server.chat.serving import RenderedChat
from structllm.server.chat.tool_calls import call_parser
from structllm.server.http.body import maybe_off_loop, validate
from structllm.server.http.errors import ASCIIJSONResponse, anthropic_error_json
from structllm.server.http.sse import Emit, EventStream, deadline
from structllm.server.messages.blocks import ThinkingEnabled
from structllm.server.messages.protocol import (
    CountTokensRequest,
    MessagesPrompt,
    MessagesRequest,
)
from structllm.server.messages.response import (
    CountTokensResponse,
    MessageResponse,
    MessagesErrorResponse,
    MessageStartEvent,
    MessagesUsage,
    PingEvent,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from structllm.server.messages.streaming import (
    EmitEvent,
    MessageEvents,
    new_tool_use_id,
    stop_reason,
)
from structllm.server.protocol import bodies
from structllm.server.protocol.constraints import check_constraints, renamed
from structllm.server.serving import Job, Serving
from structllm.text.reasoning import ReasoningParser, split
from structllm.text.tool_parser import ToolCallParser, parse

__all__ = ["MessagesServing", "anthropic_errors", "parser_for"]

#: errors from the engine about the forced call's grammar name this field
_CONSTRAINT_FIELD = "tool_choice"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def parser_for(req: MessagesPrompt) -> ToolCallParser | None:
    """The parser chat uses for the same ``tool_choice``; None: plain text."""
    names = [t.name for t in req.tools or ()]
    return call_parser(req.tool_mode, names, parallel=req.parallel_tool_use)


def anthropic_errors(response: Response) -> Response:
    """``response`` with an OpenAI error body rewritten in Anthropic's shape
    (the message starts with the field it names, as the 400s of validation do)."""
    if response.status_code < 400 or response.media_type != "application/json":
        return response
    try:
        body = json.loads(bytes(response.body))
    except ValueError:
        return response
    error = body.get("error") if isinstance(body, dict) else None
    if body.get("type") == "error" or not isinstance(error, dict):
        return response
    headers = {
        k: v
        for k, v in response.headers.items()
        if k not in ("content-length", "content-type")
    }
    message, param = str(error.get("message", "")), error.get("param")
    if param and not message.startswith(f"{param}:"):
        message = f"{param}: {message}"  # Anthropic's body has no param
    return Response(
        anthropic_error_json(response.status_code, message),
        status_code=response.status_code,
        headers=headers,
        media_type="application/json",
    )


@attrs.define(eq=False)
class MessagesServing(Serving):
    """The Messages endpoints' logic (the routes only call ``create`` and
    ``count_tokens``)."""

    async def guarded(
        self, request: Request, handler: Callable[[Any, bool], Awaitable[Response]]
    ) -> Response:
        return anthropic_errors(await super().guarded(request, handler))

    def error_response(self, exc: BaseException) -> Response | None:
        response = super().error_response(exc)
        return None if response is None else anthropic_errors(response)

    def reasoning_parser_name(self, llm: AsyncLLM, req: MessagesPrompt) -> str | None:
        """The reasoning parser this server runs (``--reasoning-parser``,
        ``auto`` by the chat template); ``thinking`` enabled needs one."""
        name = reasoning.parser_name(
            self.config.reasoning_parser, llm.tokenizer.chat_template
        )
        if name is None and isinstance(req.thinking, ThinkingEnabled):
            raise InvalidRequestError(
                "thinking: extended thinking needs a reasoning parser, and this "
                "server has none (--reasoning-parser, or a model whose chat "
                "template calls for one)",
                field="thinking",
            )
        return name

    async def count_tokens(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        req = await maybe_off_loop(big, validate, CountTokensRequest, body)
        self.check_model_or_adapter(req.model)  # an adapter counts as its base
        self.reasoning_parser_name(llm, req)  # a 400 here as there
        await check_constraints(req.constraint_checks)
        prompt = await self._render(llm, req)
        response = CountTokensResponse(input_tokens=len(prompt.token_ids))
        return ASCIIJSONResponse(bodies.dump(response))

    async def create(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        req = await maybe_off_loop(big, validate, MessagesRequest, body)
        adapter = self.check_model_or_adapter(req.model)
        parser_name = self.reasoning_parser_name(llm, req)
        await check_constraints(req.constraint_checks)
        prompt = await self._render(llm, req)
        self.check_length(llm, prompt.token_ids, req.max_tokens, "max_tokens")
        chat = RenderedChat.with_reasoning(
            parser_name, prompt, req.to_sampling_params(), req.template_kwargs
        )
        job = Job(0, 0, chat.prompt, chat.params, lora_request=adapter)
        if req.stream:
            return self._stream(llm, req, job, chat.reasoning_parser())
        with renamed(_CONSTRAINT_FIELD):
            finals = await self.run_to_end([job])
        out = finals[0]
        c = out.outputs[0]
        content, called = _content(req, c, chat.reasoning_parser())
        reason, sequence = stop_reason(c, called)
        response = MessageResponse(
            id=new_message_id(),
            model=self.served_name(adapter),
            content=content,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=MessagesUsage(
                input_tokens=len(prompt.token_ids),
                output_tokens=len(c.token_ids),
                cache_read_input_tokens=out.num_cached_tokens or 0,
            ),
        )
        return ASCIIJSONResponse(bodies.dump(response))

    async def _render(self, llm: AsyncLLM, req: MessagesPrompt) -> Prompt:
        """The conversation through the chat template, as chat renders it."""
        try:
            return await self.render_messages(
                llm, req.template_messages(), req.template_options()
            )
        except InvalidRequestError as exc:
            if exc.field != "continue_final_message":
                raise
            # chat's field: here it is the final (prefill) message
            field = f"messages[{len(req.messages) - 1}]"
            message = str(exc).replace("continue_final_message", field, 1)
            raise InvalidRequestError(message, field=field) from None

    def _stream(
        self,
        llm: AsyncLLM,
        req: MessagesRequest,
        job: Job,
        thinking: ReasoningParser | None,
    ) -> EventStream:
        """The answer as Anthropic's events.

        What can be refused is refused before the 200 (a 400, or 503 on
        overload); a failure after it is the last event, ``error``.
        """
        llm.check_admission(job.prompt.token_ids, count=1, params=job.params)
        limit = self.limit(None)  # --request-timeout, or X-Request-Timeout's
        events = MessageEvents(parser_for(req), thinking)
        start = MessageStartEvent(
            message=MessageResponse(
                id=new_message_id(),
                model=self.served_name(job.lora_request),
                content=[],
                stop_reason=None,
                stop_sequence=None,
                usage=MessagesUsage(
                    input_tokens=len(job.prompt.token_ids),
                    output_tokens=0,
                    cache_read_input_tokens=0,
                ),
            )
        )

        async def produce(emit_json: Emit) -> None:
            async def emit(event: BaseModel) -> None:
                await emit_json(bodies.dump(event))

            await emit(start)
            await emit(PingEvent())

            async def on_output(o: RequestOutput) -> None:
                c = o.outputs[0]
                for event in events.feed(c.text, c.finished):
                    await emit(event)
                if c.finished:
                    for event in events.finish(c, o.num_generated_tokens):
                        await emit(event)

            try:
                with deadline(limit), renamed(_CONSTRAINT_FIELD):
                    await self.observe(job, on_output)
            except BaseExceptionGroup as group:
                await self._fail(emit, unwrap_group(group), group)
            except Exception as exc:  # RequestTimeoutError, the engine's errors
                await self._fail(emit, exc, exc)

        return EventStream(produce, named=True)  # event: its type; no [DONE]

    async def _fail(
        self, emit: EmitEvent, exc: BaseException, raised: BaseException
    ) -> None:
        """The ``error`` event for a known failure; anything else re-raised."""
        response = self.error_response(exc)
        if response is None:
            raise raised
        await emit(
            MessagesErrorResponse.model_validate(json.loads(bytes(response.body)))
        )


def _content(
    req: MessagesRequest, c: CompletionOutput, thinking: ReasoningParser | None
) -> tuple[list[ThinkingBlock | TextBlock | ToolUseBlock], bool]:
    """A whole answer's blocks, and whether it called tools.

    With a reasoning parser, the thinking it splits off is a ``thinking``
    block before the others (when there is any), as in
    :class:`~structllm.server.messages.streaming.MessageEvents`. An answer
    whose calls did not complete (cut by ``max_tokens``) is its text, as in
    chat.
    """
    answer = c.text
    head: list[ThinkingBlock | TextBlock | ToolUseBlock] = []
    if thinking is not None:
        d = split(thinking, c.text)
        answer = d.content
        if d.reasoning:
            head.append(ThinkingBlock(thinking=d.reasoning))
    parser = parser_for(req)
    parsed = parse(parser, answer) if parser is not None else None
    if parsed is None or not parsed.calls or not parsed.complete:
        return [*head, TextBlock(text=answer)], False
    inputs = [json.loads(call.arguments) for call in parsed.calls]
    if not all(isinstance(i, dict) for i in inputs):  # Anthropic's input is one
        return [*head, TextBlock(text=answer)], False
    blocks = head
    if parsed.content and parsed.content.strip():
        # the whitespace before the calls is no part of the text
        blocks.append(TextBlock(text=parsed.content.rstrip()))
    blocks += [
        ToolUseBlock(id=new_tool_use_id(), name=call.name, input=i)
        for call, i in zip(parsed.calls, inputs, strict=True)
    ]
    return blocks, True
