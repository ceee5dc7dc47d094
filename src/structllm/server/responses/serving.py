"""``POST /v1/responses``: a chat request underneath, output items on top.

A request is validated as a
:class:`~structllm.server.responses.protocol.ResponsesRequest`, turned into
a chat request (after the conversation ``previous_response_id`` names, from
the :class:`~structllm.server.responses.store.ResponseStore`) and rendered
by chat's serving (:meth:`ChatServing.render
<structllm.server.chat.serving.ChatServing.render>`: template, tools,
structured output, reasoning), so both APIs write the same prompt. Its one
choice runs as one engine request.

The text that comes back becomes output items and their events in
:class:`~structllm.server.responses.output.Output`, as it streams or whole.
A response created with ``store: true``
is kept (:mod:`~structllm.server.responses.store`): ``GET`` and ``DELETE
/v1/responses/{id}`` read and forget it. The stream starts with
``response.created`` and ``response.in_progress`` and ends with
``response.completed`` (also when the output was cut by
``max_output_tokens``: the response's status is then ``incomplete``), or
with an ``error`` event if the request fails after its 200.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any, Literal

import attrs
from fastapi.responses import Response

from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.errors import InvalidRequestError, unwrap_group
from structllm.lora_request import LoRARequest
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
from structllm.server.responses.objects import (
    DeletedResponse,
    ErrorEvent,
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseEvent,
    ResponseObject,
    ResponseUsage,
)
from structllm.server.responses.output import Output, new_id
from structllm.server.responses.protocol import ResponsesRequest, responses_field
from structllm.server.responses.store import ResponseStore
from structllm.server.serving import Job, Serving

__all__ = ["ResponsesServing"]


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
        adapter = self.check_model_or_adapter(req.model)
        history = self.store.conversation(req.previous_response_id)
        with _responses_fields():
            chat_req = validate(ChatRequest, req.chat_body(history))
            chat = await self._chat.render(llm, chat_req)
        job = Job(0, 0, chat.prompt, chat.params, lora_request=adapter)
        answer = AnswerParser(tool_calls.parser_for(chat_req), chat.reasoning_parser())
        run = _Run(req, new_id("resp"), bodies.now(), history, Output(answer), adapter)
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
            model=self.served_name(run.adapter),
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
    output: Output
    #: the LoRA adapter its ``model`` named (None: the base model)
    adapter: LoRARequest | None
