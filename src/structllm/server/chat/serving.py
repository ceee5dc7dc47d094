"""``POST /v1/chat/completions``: messages through the chat template, then
choices, whole or streamed.

A request is validated as a :class:`~structllm.server.chat.protocol.ChatRequest`,
its messages are rendered with the model's chat template and tokenised (off
the event loop when long), and each of the ``n`` choices becomes one engine
request; the responses are :mod:`structllm.server.chat.protocol` models.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
from fastapi.responses import Response

from structllm.engine.frontend.inputs import OFF_LOOP_CHARS, Prompt, check_prompt_bytes
from structllm.outputs import RequestOutput
from structllm.server.chat import tool_calls
from structllm.server.chat.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatFinishReason,
    ChatRequest,
    ChatStreamChoice,
)
from structllm.server.chat.tool_calls import StreamedCalls
from structllm.server.http.body import maybe_off_loop, validate
from structllm.server.http.errors import ASCIIJSONResponse
from structllm.server.http.sse import deadline
from structllm.server.protocol import bodies
from structllm.server.protocol import logprobs as lp
from structllm.server.protocol.constraints import check_constraints, renamed
from structllm.server.protocol.logprobs import chat_logprobs
from structllm.server.serving import Chunks, Job, Serving

__all__ = ["ChatServing"]


@attrs.define(eq=False)
class ChatServing(Serving):
    """The chat endpoint's logic (the route only calls ``create``)."""

    async def create(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        req = await maybe_off_loop(big, validate, ChatRequest, body)
        self.check_model(req.model)
        await check_constraints(req.constraint_checks)
        params = req.to_sampling_params(None)
        messages = req.template_messages()
        size = sum(len(m["content"]) for m in messages)
        cap = llm.max_prompt_bytes
        if cap is not None and 4 * size > cap:  # 4: the most bytes per char
            text = "".join(m["content"] for m in messages)
            check_prompt_bytes(text, cap, field="messages")
        options = req.template_options()
        tools = options["tools"]
        # the template writes the tools out too: count them for the thread
        rendered = size + (len(json.dumps(tools)) if tools else 0)

        def render() -> tuple[str, tuple[int, ...]]:
            text = llm.tokenizer.apply_chat_template(messages, **options)
            # the template writes BOS itself: tokenise without special tokens
            return text, tuple(llm.tokenizer.encode(text, add_special_tokens=False))

        text, ids = await maybe_off_loop(rendered > OFF_LOOP_CHARS, render)
        prompt = Prompt(text, ids, req.cache_salt)
        limit = req.max_completion_tokens or req.max_tokens
        self.check_length(llm, ids, limit, req.limit_field)
        jobs = [
            Job(j, 0, prompt, params.for_choice(j), req.priority or 0)
            for j in range(req.choices)
        ]
        top_logprobs = params.logprobs or 0
        if req.stream:
            chunks = _Chunks(self, req, bodies.new_id("chatcmpl"), top_logprobs)
            with renamed(req.constraint_field):
                return self.stream(llm, jobs, chunks, req.constraint_field, req.timeout)
        with renamed(req.constraint_field), deadline(self.limit(req.timeout)):
            finals = await self.run_to_end(jobs)
        extra: dict[str, Any] = {}
        if req.return_token_ids:
            extra["prompt_token_ids"] = list(prompt.token_ids)
        if (pl := lp.prompt_logprobs(finals[0])) is not None:
            extra["prompt_logprobs"] = pl  # the prompt's: every choice's
        response = ChatCompletionResponse(
            **self.head(bodies.new_id("chatcmpl")),
            choices=[_choice(req, i, finals[i], top_logprobs) for i in sorted(finals)],
            usage=self.final_usage(jobs, finals),
            **extra,
        )
        return ASCIIJSONResponse(bodies.dump(response))


def _choice(
    req: ChatRequest, index: int, out: RequestOutput, top_logprobs: int
) -> ChatChoice:
    c = out.outputs[0]
    extra: dict[str, Any] = {}
    if req.return_token_ids:
        extra["token_ids"] = list(c.token_ids)
    message, finish_reason = tool_calls.message(req, c)
    return ChatChoice(
        index=index,
        message=message,
        logprobs=chat_logprobs(
            c, top_logprobs, as_ids=bool(req.return_tokens_as_token_ids)
        ),
        finish_reason=finish_reason,
        stop_reason=c.stop_reason,
        **extra,
    )


@attrs.frozen
class _Chunks(Chunks[ChatRequest]):
    """The chunks of a streaming chat completion (a StreamFormat)."""

    top_logprobs: int
    #: each choice's tool-call parser, by choice index (when tools are parsed)
    calls: dict[int, StreamedCalls] = attrs.field(factory=dict)

    def _chunk(
        self,
        choices: list[ChatStreamChoice],
        usage: bodies.Usage | None,
        **extra: Any,
    ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            **self.head(usage), choices=choices, **extra
        )

    def opening(
        self, job: Job, usage: bodies.Usage | None
    ) -> ChatCompletionStreamResponse:
        """The assistant's role (and vLLM's echo) before any generated token.

        When calls are parsed, ``content`` is left out unless echoed: an
        answer of calls alone has none.
        """
        echo = self.req.echo_text
        parsed = tool_calls.parser_for(self.req) is not None
        delta = (
            ChatDelta(role="assistant")
            if parsed and not echo
            else ChatDelta(role="assistant", content=echo)
        )
        first = ChatStreamChoice(
            index=job.index,
            delta=delta,
            logprobs=None,
            finish_reason=None,
        )
        extra: dict[str, Any] = {}
        if self.req.return_token_ids and job.index == 0:
            extra["prompt_token_ids"] = list(job.prompt.token_ids)
        return self._chunk([first], usage, **extra)

    def delta(
        self, job: Job, out: RequestOutput, usage: bodies.Usage | None
    ) -> ChatCompletionStreamResponse:
        c = out.outputs[0]
        finish: ChatFinishReason | None = c.finish_reason
        calls = self.calls.get(job.index)
        if calls is None and (parser := tool_calls.parser_for(self.req)) is not None:
            calls = self.calls[job.index] = StreamedCalls(parser)
        if calls is not None:
            delta = calls.delta(c.text, finish is not None)
            finish = tool_calls.finish_reason(finish, calls.called)
        elif c.text or not finish:
            delta = ChatDelta(content=c.text)
        else:
            delta = ChatDelta()
        choice = ChatStreamChoice(
            index=job.index,
            delta=delta,
            logprobs=chat_logprobs(
                c, self.top_logprobs, as_ids=bool(self.req.return_tokens_as_token_ids)
            ),
            finish_reason=finish,
            **self.finish_fields(c),
        )
        extra: dict[str, Any] = {}
        if (pl := lp.prompt_logprobs(out)) is not None:  # the choice's first
            extra["prompt_logprobs"] = pl
        return self._chunk([choice], usage, **extra)

    def closing(self, usage: bodies.Usage) -> ChatCompletionStreamResponse:
        return self._chunk([], usage)
