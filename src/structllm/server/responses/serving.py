"""``POST /v1/responses``: a chat request underneath, output items on top.

A request is validated as a
:class:`~structllm.server.responses.protocol.ResponsesRequest`, turned into
a chat request (after the conversation ``previous_response_id`` names, from
the :class:`~structllm.server.responses.store.ResponseStore`) and rendered
by chat's serving (:meth:`ChatServing.render
<structllm.server.chat.serving.ChatServing.render>`: template, tools,
structured output, reasoning), so both APIs write the same prompt. Its one
choice runs as one engine request.

The text that comes back goes through chat's
:class:`~structllm.server.chat.tool_calls.AnswerParser` (reasoning split
off, then calls found in the answer) into output items: a ``reasoning``
item, ``message`` items, ``function_call`` items, in the order the model
wrote them. :class:`_Output` builds them as the text streams and writes the
events the openai SDK reads (``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``, ...
``response.output_item.done``); a whole response is the same builder fed
once, so the two cannot differ. A response created with ``store: true``
is kept (:mod:`~structllm.server.responses.store`): ``GET`` and ``DELETE
/v1/responses/{id}`` read and forget it. The stream starts with
``response.created`` and ``response.in_progress`` and ends with
``response.completed`` (also when the output was cut by
``max_output_tokens``: the response's status is then ``incomplete``), or
with an ``error`` event if the request fails after its 200.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid
from collections.abc import Iterator
from typing import Any, Literal

import attrs
from fastapi.responses import Response
from pydantic import BaseModel

from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.errors import InvalidRequestError, unwrap_group
from structllm.outputs import RequestOutput
from structllm.server.chat import tool_calls
from structllm.server.chat.protocol import ChatRequest
from structllm.server.chat.serving import ChatServing
from structllm.server.chat.tool_calls import AnswerParser
from structllm.server.http.body import maybe_off_loop, validate
from structllm.server.http.errors import ASCIIJSONResponse, json_error
from structllm.server.http.sse import Emit, EventStream, deadline
from structllm.server.protocol import bodies
from structllm.server.protocol.constraints import rename_field
from structllm.server.responses.protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    DeletedResponse,
    ErrorEvent,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningText,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
    responses_field,
)
from structllm.server.responses.store import ResponseStore
from structllm.server.serving import Job, Serving
from structllm.text.tool_parser import ArgumentsDelta, CallStart, ContentDelta

__all__ = ["ResponsesServing"]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@contextlib.contextmanager
def _responses_fields(constraint_field: str | None = None) -> Iterator[None]:
    """Errors about the chat request underneath name the Responses field."""
    try:
        yield
    except InvalidRequestError as exc:
        raise responses_field(rename_field(exc, constraint_field)) from None
    except BaseExceptionGroup as group:
        leaf = unwrap_group(group)
        if isinstance(leaf, InvalidRequestError):
            raise responses_field(rename_field(leaf, constraint_field)) from None
        raise


@attrs.define(eq=False)
class ResponsesServing(Serving):
    """The Responses endpoint's logic (the route only calls ``create``)."""

    store: ResponseStore = attrs.field(init=False, factory=ResponseStore)
    _chat: ChatServing = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._chat = ChatServing(self.slot, self.config, self.metrics)

    async def create(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        req = await maybe_off_loop(big, validate, ResponsesRequest, body)
        self.check_model(req.model)
        history = self.store.conversation(req.previous_response_id)
        with _responses_fields():
            chat_req = validate(ChatRequest, req.chat_body(history))
            chat = await self._chat.render(llm, chat_req)
        job = Job(0, 0, chat.prompt, chat.params)
        answer = AnswerParser(tool_calls.parser_for(chat_req), chat.reasoning_parser())
        run = _Run(req, _new_id("resp"), bodies.now(), history, _Output(answer))
        if req.stream:
            return self._stream(llm, job, run, chat_req.constraint_field)
        with _responses_fields(chat_req.constraint_field):
            final = (await self.run_to_end([job]))[0]
        c = final.outputs[0]
        run.output.feed(c.text, finished=True, cut=c.finish_reason == "length")
        response = bodies.dump(self._response(llm, run, final))
        self._keep(run, response)
        return ASCIIJSONResponse(response)

    def retrieve(self, response_id: str) -> Response:
        """``GET /v1/responses/{id}``: a stored response as it was sent."""
        kept = self.store.get(response_id)
        if kept is None:
            return _not_kept(response_id)
        return ASCIIJSONResponse(kept.response)

    def delete(self, response_id: str) -> Response:
        """``DELETE /v1/responses/{id}``: forget a stored response."""
        if not self.store.delete(response_id):
            return _not_kept(response_id)
        deleted = DeletedResponse(id=response_id)
        return ASCIIJSONResponse(bodies.dump(deleted))

    def _stream(
        self, llm: AsyncLLM, job: Job, run: _Run, constraint_field: str | None
    ) -> EventStream:
        """The events; what can be refused is refused before the 200."""
        llm.check_admission(job.prompt.token_ids, count=1, params=job.params)
        seq = run.output.seq
        limit = self.limit(None)  # --request-timeout, or X-Request-Timeout's

        async def produce(emit: Emit) -> None:
            head = self._response(llm, run, None)
            for kind in ("response.created", "response.in_progress"):
                event = ResponseEvent(
                    type=kind, sequence_number=next(seq), response=head
                )
                await emit(bodies.dump(event))

            async def on_output(o: RequestOutput) -> None:
                c = o.outputs[0]
                finished = c.finish_reason is not None
                cut = c.finish_reason == "length"
                for e in run.output.feed(c.text, finished=finished, cut=cut):
                    await emit(bodies.dump(e))

            try:
                with (
                    deadline(limit),
                    _responses_fields(constraint_field),
                ):
                    final = await self.observe(job, on_output)
            except BaseException as exc:
                leaf = unwrap_group(exc) if isinstance(exc, BaseExceptionGroup) else exc
                response = self.error_response(leaf)
                if response is None:
                    raise
                error = json.loads(bytes(response.body))["error"]
                failed = ErrorEvent(
                    sequence_number=next(seq),
                    code=None if error["code"] is None else str(error["code"]),
                    message=error["message"],
                    param=error["param"],
                )
                await emit(bodies.dump(failed))
                return
            whole = self._response(llm, run, final)
            self._keep(run, bodies.dump(whole))
            done = ResponseEvent(
                type="response.completed", sequence_number=next(seq), response=whole
            )
            await emit(bodies.dump(done))

        return EventStream(produce, named=True)  # event: its type, as OpenAI

    def _response(
        self, llm: AsyncLLM, run: _Run, final: RequestOutput | None
    ) -> ResponseObject:
        """The response: in progress (``final`` None) or finished."""
        status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
        usage = incomplete = None
        if final is not None:
            c = final.outputs[0]
            status = "incomplete" if c.finish_reason == "length" else "completed"
            if status == "incomplete":
                incomplete = IncompleteDetails(reason="max_output_tokens")
            thought = run.output.reasoning_text
            reasoning_tokens = (
                len(llm.tokenizer.encode(thought, add_special_tokens=False))
                if thought
                else 0
            )
            prompt_tokens, generated = len(final.prompt_token_ids), len(c.token_ids)
            usage = ResponseUsage(
                input_tokens=prompt_tokens,
                input_tokens_details=InputTokensDetails(
                    cached_tokens=final.num_cached_tokens or 0
                ),
                output_tokens=generated,
                output_tokens_details=OutputTokensDetails(
                    reasoning_tokens=min(reasoning_tokens, generated)
                ),
                total_tokens=prompt_tokens + generated,
            )
        return ResponseObject(
            id=run.rid,
            created_at=run.created_at,
            model=self.config.model_name,
            status=status,
            incomplete_details=incomplete,
            output=run.output.items() if final is not None else [],
            usage=usage,
            **run.req.echo_fields(),
        )

    def _keep(self, run: _Run, response: dict[str, Any]) -> None:
        """Keep the response and its conversation (``store: true``)."""
        if run.req.store:
            messages = run.history + run.req.input_messages()
            self.store.put(response, messages + run.output.messages())


def _not_kept(response_id: str) -> Response:
    return json_error(
        404,
        f"no stored response {response_id!r} (only responses created with "
        f"store: true on this server are kept)",
        param="response_id",
    )


@attrs.frozen
class _Run:
    """One response being made."""

    req: ResponsesRequest
    rid: str
    created_at: int
    #: the conversation before it (previous_response_id)
    history: list[dict[str, Any]]
    output: _Output


@attrs.define
class _Item:
    """An output item as it is built."""

    kind: Literal["reasoning", "message", "function_call"]
    id: str
    index: int
    parts: list[str] = attrs.field(factory=list)
    name: str = ""
    call_id: str = ""
    #: the parser's index of the call (function_call items)
    call_index: int = -1
    status: ItemStatus = "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def model(self) -> OutputItem:
        """The item as sent (just added: no content yet)."""
        empty = not self.parts and self.status == "in_progress"
        if self.kind == "message":
            content = [] if empty else [OutputText(text=self.text)]
            return OutputMessage(id=self.id, status=self.status, content=content)
        if self.kind == "reasoning":
            thought = [] if empty else [ReasoningText(text=self.text)]
            return OutputReasoning(id=self.id, status=self.status, content=thought)
        return OutputFunctionCall(
            id=self.id,
            call_id=self.call_id,
            name=self.name,
            arguments=self.text,
            status=self.status,
        )


@attrs.define
class _Output:
    """One output's items, built as its text arrives, and the events that
    tell a client about them."""

    answer: AnswerParser
    seq: Iterator[int] = attrs.field(factory=itertools.count)
    _items: list[_Item] = attrs.field(factory=list)
    #: whitespace that would open a message: sent with the text after it
    _blank: str = ""
    _events: list[BaseModel] = attrs.field(factory=list)

    def items(self) -> list[OutputItem]:
        return [item.model() for item in self._items]

    @property
    def reasoning_text(self) -> str:
        return "".join(i.text for i in self._items if i.kind == "reasoning")

    def messages(self) -> list[dict[str, Any]]:
        """The output as the assistant message a chat template receives."""
        text = "".join(i.text for i in self._items if i.kind == "message")
        calls = [
            {
                "id": i.call_id,
                "type": "function",
                "function": {"name": i.name, "arguments": i.text},
            }
            for i in self._items
            if i.kind == "function_call" and i.status == "completed"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return [message]

    def feed(self, text: str, *, finished: bool, cut: bool) -> list[BaseModel]:
        """The events ``text`` makes (all items closed when ``finished``)."""
        thought, events = self.answer.feed(text, finished)
        if thought:
            self._add("reasoning", thought)
        for e in events:
            if isinstance(e, ContentDelta):
                self._content(e.text)
            elif isinstance(e, CallStart):
                self._open("function_call", name=e.name, call_index=e.index)
            elif isinstance(e, ArgumentsDelta) and e.text:
                self._add("function_call", e.text)
        if finished:
            self._close("incomplete" if cut else "completed")
        out, self._events = self._events, []
        return out

    @property
    def _current(self) -> _Item | None:
        item = self._items[-1] if self._items else None
        return item if item is not None and item.status == "in_progress" else None

    def _content(self, text: str) -> None:
        current = self._current
        if current is None or current.kind != "message":
            if not (self._blank + text).strip():
                self._blank += text
                return
            text, self._blank = self._blank + text, ""
        self._add("message", text)

    def _open(
        self,
        kind: Literal["reasoning", "message", "function_call"],
        *,
        name: str = "",
        call_index: int = -1,
    ) -> _Item:
        self._close("completed")
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _Item(kind, _new_id(prefix), len(self._items), name=name)
        if kind == "function_call":
            item.call_id = tool_calls.new_call_id()
            item.call_index = call_index
        self._items.append(item)
        self._event(
            OutputItemEvent,
            type="response.output_item.added",
            output_index=item.index,
            item=item.model(),
        )
        if kind != "function_call":
            part = OutputText(text="") if kind == "message" else ReasoningText(text="")
            self._part(item, "response.content_part.added", part)
        return item

    def _add(
        self, kind: Literal["reasoning", "message", "function_call"], text: str
    ) -> None:
        item = self._current
        if item is None or item.kind != kind:
            item = self._open(kind)
        item.parts.append(text)
        where = {"item_id": item.id, "output_index": item.index}
        if kind == "message":
            self._event(TextDeltaEvent, delta=text, content_index=0, **where)
        elif kind == "reasoning":
            self._event(ReasoningDeltaEvent, delta=text, content_index=0, **where)
        else:
            self._event(ArgumentsDeltaEvent, delta=text, **where)

    def _close(self, status: ItemStatus) -> None:
        item = self._current
        if item is None:
            return
        item.status = status
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "message":
            self._event(TextDoneEvent, text=item.text, content_index=0, **where)
            self._part(item, "response.content_part.done", OutputText(text=item.text))
        elif item.kind == "reasoning":
            self._event(ReasoningDoneEvent, text=item.text, content_index=0, **where)
            part = ReasoningText(text=item.text)
            self._part(item, "response.content_part.done", part)
        else:
            self._event(
                ArgumentsDoneEvent, name=item.name, arguments=item.text, **where
            )
        self._event(
            OutputItemEvent,
            type="response.output_item.done",
            output_index=item.index,
            item=item.model(),
        )

    def _part(
        self,
        item: _Item,
        kind: Literal["response.content_part.added", "response.content_part.done"],
        part: OutputText | ReasoningText,
    ) -> None:
        self._event(
            ContentPartEvent,
            type=kind,
            item_id=item.id,
            output_index=item.index,
            content_index=0,
            part=part,
        )

    def _event(self, model: type[BaseModel], **fields: Any) -> None:
        self._events.append(model(sequence_number=next(self.seq), **fields))
