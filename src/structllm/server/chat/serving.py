"""``POST /v1/chat/completions``: messages through the chat template, then
choices, whole or streamed.

A request is validated as a :class:`~structllm.server.chat.protocol.ChatRequest`,
its messages are rendered with the model's chat template and tokenised (off
the event loop when long), and each of the ``n`` choices becomes one engine
request; the responses are :mod:`structllm.server.chat.protocol` models.

With a reasoning parser (:mod:`structllm.server.chat.reasoning`), each
choice's thinking goes to ``reasoning_content`` and the rest (content, tool
calls) is parsed from the answer alone. :meth:`ChatServing.render` (checks,
template, tokens, the parameters and reasoning parser a request runs with)
is what ``/v1/responses`` renders its requests with too.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import attrs
from fastapi.responses import Response

from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.frontend.inputs import Prompt
from structllm.outputs import RequestOutput
from structllm.params import SamplingParams
from structllm.server.chat import reasoning, tool_calls
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
from structllm.text.reasoning import ReasoningParser

__all__ = ["ChatServing", "RenderedChat"]


@attrs.frozen
class RenderedChat:
    """A chat request made ready to run: its prompt and parameters."""

    prompt: Prompt
    #: the request's, its output constraint held to the answer (reasoning)
    params: SamplingParams
    #: each choice's reasoning parser starts as a copy of this one (None:
    #: no reasoning parser)
    reasoning: ReasoningParser | None

    @classmethod
    def with_reasoning(
        cls,
        parser_name: str | None,
        prompt: Prompt,
        params: SamplingParams,
        template_kwargs: Mapping[str, Any] | None,
    ) -> RenderedChat:
        """``prompt`` and ``params`` with the reasoning parser ``parser_name``
        (None: none) for an output that continues ``prompt``, and the output
        constraint held to the answer (every API that renders a conversation
        finishes it here)."""
        parser = reasoning.choice_parser(
            parser_name, prompt.text or "", template_kwargs
        )
        constraint, parser = reasoning.after_thinking(params.structured_outputs, parser)
        if constraint is not params.structured_outputs:
            params = attrs.evolve(params, structured_outputs=constraint)
        return cls(prompt, params, parser)

    def reasoning_parser(self) -> ReasoningParser | None:
        """A fresh reasoning parser for one choice."""
        return None if self.reasoning is None else copy.copy(self.reasoning)


@attrs.define(eq=False)
class ChatServing(Serving):
    """The chat endpoint's logic (the route only calls ``create``)."""

    def reasoning_parser_name(self, llm: AsyncLLM) -> str | None:
        """``--reasoning-parser``, ``auto`` resolved by the chat template."""
        return reasoning.parser_name(
            self.config.reasoning_parser, llm.tokenizer.chat_template
        )

    async def render(self, llm: AsyncLLM, req: ChatRequest) -> RenderedChat:
        """Check ``req``'s constraints, render and tokenise its messages
        (:meth:`~structllm.server.serving.Serving.render_messages`), check
        the length; the parameters and the reasoning parser it runs with."""
        await check_constraints(req.constraint_checks)
        params = req.to_sampling_params(None)
        prompt = await self.render_messages(
            llm, req.template_messages(), req.template_options(), req.cache_salt
        )
        limit = req.max_completion_tokens or req.max_tokens
        self.check_length(llm, prompt.token_ids, limit, req.limit_field)
        return RenderedChat.with_reasoning(
            self.reasoning_parser_name(llm), prompt, params, req.chat_template_kwargs
        )

    async def create(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        req = await maybe_off_loop(big, validate, ChatRequest, body)
        adapter = self.check_model_or_adapter(req.model)
        timed = self.wants_metrics(req.include_metrics)
        chat = await self.render(llm, req)
        prompt, params = chat.prompt, chat.params
        jobs = [
            Job(
                j,
                0,
                prompt,
                params.for_choice(j),
                req.priority or 0,
                lora_request=adapter,
            )
            for j in range(req.choices)
        ]
        top_logprobs = params.logprobs or 0
        if req.stream:
            chunks = _Chunks(
                self,
                req,
                bodies.new_id("chatcmpl"),
                top_logprobs,
                chat,
                adapter=adapter,
            )
            with renamed(req.constraint_field):
                return self.stream(
                    llm, jobs, chunks, req.constraint_field, req.timeout, timed
                )
        with renamed(req.constraint_field), deadline(self.limit(req.timeout)):
            finals = await self.run_to_end(jobs)
        extra: dict[str, Any] = {}
        if req.return_token_ids:
            extra["prompt_token_ids"] = list(prompt.token_ids)
        if (pl := lp.prompt_logprobs(finals[0])) is not None:
            extra["prompt_logprobs"] = pl  # the prompt's: every choice's
        if timed:
            extra["metrics"] = self.request_metrics(jobs)
        choices = [
            _choice(req, i, finals[i], top_logprobs, chat.reasoning_parser())
            for i in sorted(finals)
        ]
        response = ChatCompletionResponse(
            **self.head(bodies.new_id("chatcmpl"), adapter),
            choices=choices,
            usage=self.final_usage(jobs, finals),
            **extra,
        )
        return ASCIIJSONResponse(bodies.dump(response))


def _choice(
    req: ChatRequest,
    index: int,
    out: RequestOutput,
    top_logprobs: int,
    reasoning: ReasoningParser | None,
) -> ChatChoice:
    c = out.outputs[0]
    extra: dict[str, Any] = {}
    if req.return_token_ids:
        extra["token_ids"] = list(c.token_ids)
    message, finish_reason = tool_calls.message(req, c, reasoning)
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
    chat: RenderedChat
    #: each choice's parsers, by choice index (when tools or reasoning are parsed)
    calls: dict[int, StreamedCalls] = attrs.field(factory=dict)
    #: neither calls nor reasoning are parsed: the text is the content
    plain: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        plain = tool_calls.parser_for(self.req) is None and self.chat.reasoning is None
        object.__setattr__(self, "plain", plain)

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
        if calls is None:
            parser = tool_calls.parser_for(self.req)
            thinking = self.chat.reasoning_parser()
            if parser is not None or thinking is not None:
                show = self.req.include_reasoning is not False
                calls = StreamedCalls(parser, thinking, include_reasoning=show)
                self.calls[job.index] = calls
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

    def delta_event(
        self, job: Job, out: RequestOutput, usage: bodies.Usage | None
    ) -> dict[str, Any]:
        """:meth:`delta`'s JSON object, built directly for a plain chunk (the
        text as content: no parser, logprobs, usage or prompt logprobs).

        The same object as ``bodies.dump(self.delta(...))``, keys in the
        same order, without building and dumping the pydantic models.
        """
        c = out.outputs[0]
        if (
            not self.plain
            or usage is not None
            or c.logprobs is not None
            or out.prompt_logprobs is not None
        ):
            return bodies.dump(self.delta(job, out, usage))
        finish = c.finish_reason
        choice: dict[str, Any] = {
            "index": job.index,
            "delta": {"content": c.text} if c.text or not finish else {},
            "logprobs": None,
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = c.stop_reason
        if self.req.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return self.plain_chunk("chat.completion.chunk", choice)

    def closing(
        self, usage: bodies.Usage, metrics: bodies.PerRequestMetrics | None
    ) -> ChatCompletionStreamResponse:
        extra = {} if metrics is None else {"metrics": metrics}
        return self._chunk([], usage, **extra)
