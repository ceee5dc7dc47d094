"""``POST /v1/chat/completions/batch``: its request model.

vLLM's batch route takes the body of ``/v1/chat/completions`` with
``messages`` a list of conversations, and answers one
:class:`~structllm.server.chat.protocol.ChatCompletionResponse` whose
choice ``i`` answers conversation ``i``. As in vLLM, a batch is not
streamed, calls no tools and has one choice per conversation: ``stream``,
``tools``, ``tool_choice`` (other than ``"none"``) and ``n`` (other than 1)
are refused naming them. Each conversation is then validated as a
:class:`~structllm.server.chat.protocol.ChatRequest` of its own
(:meth:`BatchChatRequest.conversations`), so every other field means what
it means there; an error names ``messages[i]...``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from structllm.errors import InvalidRequestError
from structllm.server.chat.messages import Message
from structllm.server.chat.protocol import ChatRequest
from structllm.server.http.body import validate
from structllm.server.protocol.fields import MAX_CHOICES, MAX_MESSAGES, REQUEST_CONFIG

__all__ = ["BATCH_REFUSED", "BatchChatRequest"]

#: field -> (reason, no-op values): what a batch does not do
BATCH_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "stream": ("batch chat completions are not streamed", (False,)),
    "tools": ("batch chat completions call no tools", ([],)),
    "tool_choice": ("batch chat completions call no tools", ("none",)),
    "n": ("a batch has one choice per conversation", (1,)),
}

Conversation = Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]


class BatchChatRequest(BaseModel):
    """The batch's own shape; the other fields are each conversation's."""

    model_config = REQUEST_CONFIG

    #: one conversation per choice
    messages: Annotated[list[Conversation], Field(min_length=1, max_length=MAX_CHOICES)]

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("body", "the request body must be a JSON object")
        for name, (reason, no_ops) in BATCH_REFUSED.items():
            value = data.get(name)
            if value is not None and not any(
                type(value) is type(ok) and value == ok for ok in no_ops
            ):
                raise PydanticCustomError(
                    "refused", "{reason}", {"name": name, "reason": reason}
                )
        return data

    @staticmethod
    def conversations(body: dict[str, Any]) -> list[ChatRequest]:
        """Each conversation of ``body`` (already a valid batch) as a chat
        request; an error names its path in the batch (``messages[1][0].role``)."""
        out = []
        for i, conversation in enumerate(body["messages"]):
            try:
                out.append(validate(ChatRequest, {**body, "messages": conversation}))
            except InvalidRequestError as exc:
                raise _in_conversation(exc, i) from None
        return out


def _in_conversation(exc: InvalidRequestError, i: int) -> InvalidRequestError:
    own = exc.field or ""
    if not own.startswith("messages"):
        return exc  # a field the conversations share
    field = f"messages[{i}]{own.removeprefix('messages')}"
    return InvalidRequestError(str(exc).replace(own, field, 1), field=field)
