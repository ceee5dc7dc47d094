"""``POST /v1/chat/completions/batch``: each conversation through the chat
template, all of them run at once, one choice each.

The body is checked as a :class:`~structllm.server.chat_batch.protocol.BatchChatRequest`,
then each conversation as a chat request of its own; they are rendered and
tokenised as ``/v1/chat/completions`` does, and run as one response's
requests (a disconnect or the deadline aborts them all). The answer is
chat's :class:`~structllm.server.chat.protocol.ChatCompletionResponse` with
choice ``i`` for conversation ``i`` and the usage of all of them, as vLLM's
batch route answers.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
from fastapi.responses import Response

from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.frontend.inputs import OFF_LOOP_CHARS, Prompt, check_prompt_bytes
from structllm.outputs import RequestOutput
from structllm.server.chat import tool_calls
from structllm.server.chat.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatRequest,
)
from structllm.server.chat_batch.protocol import BatchChatRequest
from structllm.server.http.body import maybe_off_loop, validate
from structllm.server.http.errors import ASCIIJSONResponse
from structllm.server.http.sse import deadline
from structllm.server.protocol import bodies
from structllm.server.protocol.constraints import check_constraints, renamed
from structllm.server.protocol.logprobs import chat_logprobs
from structllm.server.serving import Job, Serving

__all__ = ["ChatBatchServing"]


@attrs.define(eq=False)
class ChatBatchServing(Serving):
    """The batch route's logic (the route only calls ``create``)."""

    async def create(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        # the batch's own shape first, then each conversation as a chat request
        await maybe_off_loop(big, validate, BatchChatRequest, body)
        reqs = await maybe_off_loop(big, BatchChatRequest.conversations, body)
        first = reqs[0]  # the fields besides messages are the same in each
        self.check_model(first.model)
        await check_constraints(first.constraint_checks)
        jobs = []
        for i, req in enumerate(reqs):
            prompt = await self._render(llm, req)
            limit = req.max_completion_tokens or req.max_tokens
            self.check_length(llm, prompt.token_ids, limit, req.limit_field)
            params = req.to_sampling_params(None)
            jobs.append(Job(i, i, prompt, params, req.priority or 0))
        with renamed(first.constraint_field), deadline(self.limit(first.timeout)):
            finals = await self.run_to_end(jobs)
        response = ChatCompletionResponse(
            **self.head(bodies.new_id("chatcmpl")),
            choices=[_choice(reqs[i], i, finals[i]) for i in sorted(finals)],
            usage=self.final_usage(jobs, finals),
        )
        return ASCIIJSONResponse(bodies.dump(response))

    @staticmethod
    async def _render(llm: AsyncLLM, req: ChatRequest) -> Prompt:
        """The conversation's prompt, as ``/v1/chat/completions`` renders it."""
        messages = req.template_messages()
        size = sum(len(m["content"]) for m in messages)
        cap = llm.max_prompt_bytes
        if cap is not None and 4 * size > cap:  # 4: the most bytes per char
            text = "".join(m["content"] for m in messages)
            check_prompt_bytes(text, cap, field="messages")
        options = req.template_options()
        tools = options["tools"]
        rendered = size + (len(json.dumps(tools)) if tools else 0)

        def render() -> tuple[str, tuple[int, ...]]:
            text = llm.tokenizer.apply_chat_template(messages, **options)
            # the template writes BOS itself: tokenise without special tokens
            return text, tuple(llm.tokenizer.encode(text, add_special_tokens=False))

        text, ids = await maybe_off_loop(rendered > OFF_LOOP_CHARS, render)
        return Prompt(text, ids, req.cache_salt)


def _choice(req: ChatRequest, index: int, out: RequestOutput) -> ChatChoice:
    c = out.outputs[0]
    message, finish_reason = tool_calls.message(req, c)
    top = (req.top_logprobs or 0) if req.logprobs else 0
    return ChatChoice(
        index=index,
        message=message,
        logprobs=chat_logprobs(c, top, as_ids=bool(req.return_tokens_as_token_ids)),
        finish_reason=finish_reason,
        stop_reason=c.stop_reason,
        token_ids=list(c.token_ids) if req.return_token_ids else None,
    )
