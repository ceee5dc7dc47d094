"""``POST /v1/chat/completions/batch``: each conversation through the chat
template, all of them run at once, one choice each.

The body is checked as a :class:`~structllm.server.chat_batch.protocol.BatchChatRequest`,
then each conversation as a chat request of its own; each is rendered by
chat's serving (:meth:`~structllm.server.chat.serving.ChatServing.render`:
template, tokens, length, reasoning parser), and they run as one response's
requests (a disconnect or the deadline aborts them all). The answer is
chat's :class:`~structllm.server.chat.protocol.ChatCompletionResponse` with
choice ``i`` for conversation ``i`` and the usage of all of them, as vLLM's
batch route answers.
"""

from __future__ import annotations

from typing import Any

import attrs
from fastapi.responses import Response

from structllm.outputs import RequestOutput
from structllm.server.chat import tool_calls
from structllm.server.chat.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatRequest,
)
from structllm.server.chat.serving import ChatServing
from structllm.server.chat_batch.protocol import BatchChatRequest
from structllm.server.http.body import maybe_off_loop, validate
from structllm.server.http.errors import ASCIIJSONResponse
from structllm.server.http.sse import deadline
from structllm.server.protocol import bodies
from structllm.server.protocol.constraints import renamed
from structllm.server.protocol.logprobs import chat_logprobs
from structllm.server.serving import Job, Serving
from structllm.text.reasoning import ReasoningParser

__all__ = ["ChatBatchServing"]


@attrs.define(eq=False)
class ChatBatchServing(Serving):
    """The batch route's logic (the route only calls ``create``)."""

    _chat: ChatServing = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._chat = ChatServing(self.slot, self.config, self.metrics)

    async def create(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        # the batch's own shape first, then each conversation as a chat request
        await maybe_off_loop(big, validate, BatchChatRequest, body)
        reqs = await maybe_off_loop(big, BatchChatRequest.conversations, body)
        first = reqs[0]  # the fields besides messages are the same in each
        adapter = self.check_model_or_adapter(first.model)
        timed = self.wants_metrics(first.include_metrics)
        chats = [await self._chat.render(llm, req) for req in reqs]
        jobs = [
            Job(i, i, chat.prompt, chat.params, req.priority or 0, lora_request=adapter)
            for i, (req, chat) in enumerate(zip(reqs, chats, strict=True))
        ]
        with renamed(first.constraint_field), deadline(self.limit(first.timeout)):
            finals = await self.run_to_end(jobs)
        choices = [
            _choice(reqs[i], i, finals[i], chats[i].reasoning_parser())
            for i in sorted(finals)
        ]
        response = ChatCompletionResponse(
            **self.head(bodies.new_id("chatcmpl"), adapter),
            choices=choices,
            usage=self.final_usage(jobs, finals),
            metrics=self.request_metrics(jobs) if timed else None,
        )
        return ASCIIJSONResponse(bodies.dump(response))


def _choice(
    req: ChatRequest, index: int, out: RequestOutput, reasoning: ReasoningParser | None
) -> ChatChoice:
    c = out.outputs[0]
    message, finish_reason = tool_calls.message(req, c, reasoning)
    top = (req.top_logprobs or 0) if req.logprobs else 0
    return ChatChoice(
        index=index,
        message=message,
        logprobs=chat_logprobs(c, top, as_ids=bool(req.return_tokens_as_token_ids)),
        finish_reason=finish_reason,
        stop_reason=c.stop_reason,
        token_ids=list(c.token_ids) if req.return_token_ids else None,
    )
