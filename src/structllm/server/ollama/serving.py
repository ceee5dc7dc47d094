"""Ollama's API on the engine: one request model in, NDJSON lines out.

``/api/generate`` renders ``prompt`` (and ``system``) with the model's chat
template as Ollama does, or takes it as it is with ``raw``; a ``context``
from an earlier answer is prepended. ``/api/chat`` renders ``messages`` and
``tools``; calls are found in the answer as on ``/v1/chat/completions``
with ``tool_choice: "auto"``. Both stream NDJSON unless ``stream: false``:
one object per piece of text with ``done: false``, then one with ``done:
true``, ``done_reason`` and the counts and durations (nanoseconds; the
prompt's time is the time to the first token). A request without a prompt
(or messages) only "loads" the model: ``done_reason: "load"``.
``/api/embed`` embeds one input or several at once (batched like
``/v1/embeddings``), normalised as Ollama's are; ``/api/embeddings``, the
older route, one ``prompt``, not normalised (as Ollama answers it).
A LoRA adapter's name (``:latest`` or not) is a model of every route: the
request runs with the adapter, the answer names it, and ``/api/tags``,
``/api/ps`` and ``/api/show`` describe it over the served model.

Errors are Ollama's ``{"error": "message"}`` with the status the OpenAI
routes give (400 naming the field, 404 for another model, 503...), and a
stream that fails after its 200 ends with such a line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
from fastapi import Request
from fastapi.responses import Response

import structllm
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.frontend.inputs import (
    OFF_LOOP_CHARS,
    Prompt,
    check_prompt_bytes,
    parse_prompt_off_loop,
)
from structllm.errors import InvalidRequestError, unwrap_group
from structllm.lora_request import LoRARequest
from structllm.outputs import RequestOutput
from structllm.server.embeddings.serving import embed_all, parse_input, vectors
from structllm.server.http.body import maybe_off_loop, validate
from structllm.server.http.errors import ASCIIJSONResponse, ModelNotFoundError
from structllm.server.http.sse import Emit, NDJSONStream, deadline
from structllm.server.ollama.fields import (
    Timing,
    adapter_model,
    ollama_error,
    rfc3339,
    served_model,
    token_logprobs,
)
from structllm.server.ollama.protocol import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from structllm.server.ollama.response import (
    OllamaChatMessage,
    OllamaChatResponse,
    OllamaEmbeddingsResponse,
    OllamaEmbedResponse,
    OllamaGenerateResponse,
    OllamaModel,
    OllamaProcesses,
    OllamaRunningModel,
    OllamaShowResponse,
    OllamaTags,
    OllamaVersion,
    call,
)
from structllm.server.protocol.bodies import dump
from structllm.server.protocol.constraints import check_constraints, renamed
from structllm.server.serving import Job, Serving
from structllm.text.auto_tool_parser import AutoParser
from structllm.text.tool_parser import ContentDelta, ToolCallParser, ToolEvent, collect

__all__ = ["OllamaServing"]

#: builds a line: (a delta, or the final output; done) -> the object to send
#: (None: nothing to send for this delta)
_Line = Callable[[RequestOutput, bool], dict[str, Any] | None]


@attrs.define(eq=False)
class OllamaServing(Serving):
    """``/api/generate``, ``/api/chat``, ``/api/embed`` and the model routes."""

    #: wall-clock time the server started (the model's ``modified_at``)
    started: float = attrs.field(init=False, factory=time.time)

    async def guarded(
        self, request: Request, handler: Callable[[Any, bool], Awaitable[Response]]
    ) -> Response:
        return ollama_error(await super().guarded(request, handler))

    def check_model(self, name: str | None) -> None:
        """The served name, also with Ollama's default tag ``:latest``."""
        served = self.config.model_name
        if name and name not in (served, f"{served}:latest"):
            raise ModelNotFoundError(
                f"model {name!r} not found; this server serves {served!r}"
            )

    def check_model_or_adapter(self, name: str | None) -> LoRARequest | None:
        """A LoRA adapter's name is a model too, also with ``:latest``."""
        loras = self.slot.loras
        bare = name.removesuffix(":latest") if name else None
        adapter = None if loras is None or not bare else loras.lookup(bare)
        if adapter is None:
            self.check_model(name)
        return adapter

    # -- generate ------------------------------------------------------------------

    async def generate(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        req = await maybe_off_loop(big, validate, OllamaGenerateRequest, body)
        adapter = self.check_model_or_adapter(req.model)
        name = self.served_name(adapter)
        if not req.prompt and not req.context:
            return self._loaded(OllamaGenerateResponse, name, response="")
        await check_constraints(req.constraint_checks)
        text = req.prompt or ""
        if req.raw and req.context:  # it goes on from the context: no BOS
            check_prompt_bytes(text, llm.max_prompt_bytes, "prompt")
            ids = await maybe_off_loop(
                len(text) > OFF_LOOP_CHARS,
                lambda: llm.tokenizer.encode(text, add_special_tokens=False),
            )
            prompt = Prompt(text, tuple(ids))
        elif req.raw:
            prompt = await parse_prompt_off_loop(
                text, llm.tokenizer, max_bytes=llm.max_prompt_bytes
            )
        else:
            messages = [{"role": "user", "content": text}]
            if req.system:
                messages.insert(0, {"role": "system", "content": req.system})
            prompt = await self._render(llm, messages, None)
        if req.context:
            prompt = Prompt(None, (*req.context, *prompt.token_ids))
        job = Job(0, 0, prompt, req.to_sampling_params(), lora_request=adapter)
        self._check_fits(llm, req.options, prompt)

        def line(out: RequestOutput, done: bool) -> dict[str, Any]:
            c = out.outputs[0]
            extra = (
                token_logprobs(c, req.top_logprobs) if not streamed_end(done) else {}
            )
            if not done:
                return self._line(
                    OllamaGenerateResponse, name, response=c.text, **extra
                )
            return self._line(
                OllamaGenerateResponse,
                name,
                response="" if req.streaming else c.text,
                context=[*prompt.token_ids, *c.token_ids],
                **extra,
                **timing.fields(out),
            )

        def streamed_end(done: bool) -> bool:
            """The last line of a stream: every token's logprobs were sent."""
            return done and req.streaming

        timing = Timing()
        return await self._answer(llm, job, req.streaming, line, timing)

    # -- chat ------------------------------------------------------------------------

    async def chat(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        req = await maybe_off_loop(big, validate, OllamaChatRequest, body)
        adapter = self.check_model_or_adapter(req.model)
        name = self.served_name(adapter)
        if not req.messages:
            message = OllamaChatMessage(content="")
            return self._loaded(OllamaChatResponse, name, message=message)
        await check_constraints(req.constraint_checks)
        prompt = await self._render(llm, req.template_messages(), req.template_tools())
        job = Job(0, 0, prompt, req.to_sampling_params(), lora_request=adapter)
        self._check_fits(llm, req.options, prompt)
        names = [t.function.name for t in req.tools or ()]
        parser: ToolCallParser | None = AutoParser(names) if names else None
        events: list[ToolEvent] = []

        def line(out: RequestOutput, done: bool) -> dict[str, Any] | None:
            c = out.outputs[0]
            logprobs = (
                {} if done and req.streaming else token_logprobs(c, req.top_logprobs)
            )
            if parser is None:
                content = c.text if not done or not req.streaming else ""
                message = OllamaChatMessage(content=content)
            elif not done:  # the parser holds back what may be a call
                new = parser.feed(c.text)
                events.extend(new)
                content = "".join(e.text for e in new if isinstance(e, ContentDelta))
                if not content and not logprobs:
                    return None
                message = OllamaChatMessage(content=content)
            else:
                if not req.streaming:
                    events.extend(parser.feed(c.text))
                new = parser.finish()
                events.extend(new)
                parsed = collect(events, complete=parser.complete)
                calls = [call(p.name, p.arguments) for p in parsed.calls]
                if req.streaming:
                    content = "".join(
                        e.text for e in new if isinstance(e, ContentDelta)
                    )
                else:
                    content = parsed.content or ""
                if not parsed.complete:  # cut short: the text as it is
                    calls = []
                    content = c.text if not req.streaming else content
                message = OllamaChatMessage(content=content)
                if calls:
                    message = OllamaChatMessage(content=content, tool_calls=calls)
            if not done:
                return self._line(OllamaChatResponse, name, message=message, **logprobs)
            return self._line(
                OllamaChatResponse,
                name,
                message=message,
                **logprobs,
                **timing.fields(out),
            )

        timing = Timing()
        return await self._answer(llm, job, req.streaming, line, timing)

    # -- the model ------------------------------------------------------------------

    def tags(self) -> OllamaTags:
        """The served model, then its LoRA adapters (each names it as its
        ``parent_model``)."""
        return OllamaTags(models=self._models())

    def processes(self) -> OllamaProcesses:
        llm = self.slot.get()
        forever = datetime.now(UTC) + timedelta(days=365 * 100)
        running = [
            OllamaRunningModel(
                **dump(model),
                expires_at=forever.isoformat().replace("+00:00", "Z"),
                size_vram=0,
                context_length=llm.max_model_len,
            )
            for model in self._models()
        ]
        return OllamaProcesses(models=running)

    async def show(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        req = validate(OllamaShowRequest, body)
        name = req.model or req.name
        if name is None:
            raise InvalidRequestError("model: required", field="model")
        adapter = self.check_model_or_adapter(name)
        name = self.config.model_name
        model = (
            served_model(llm, name, self.started)
            if adapter is None
            else adapter_model(adapter, name, self.started)
        )
        # a Modelfile's own words for an adapter over its base
        over = "" if adapter is None else f"ADAPTER {adapter.lora_path}\n"
        show = OllamaShowResponse(
            modelfile=f"# served by structllm\nFROM {llm.engine_config.model}\n{over}",
            parameters="",
            template=llm.tokenizer.chat_template or "",
            details=model.details,
            model_info={
                "general.architecture": model.details.family,
                "general.basename": self.config.model_name,
                "context_length": llm.max_model_len,
                "vocab_size": llm.vocab_size,
            },
            capabilities=["completion", "tools", "embedding"],
            modified_at=model.modified_at,
        )
        return ASCIIJSONResponse(dump(show))

    # -- embeddings ---------------------------------------------------------------

    async def embed(self, body: Any, big: bool) -> Response:
        """``/api/embed``: every input, normalised (Ollama's), batched."""
        llm = self.slot.get()
        req = await maybe_off_loop(big, validate, OllamaEmbedRequest, body)
        adapter = self.check_model_or_adapter(req.model)
        start = time.monotonic()
        prompts = [await parse_input(llm, text) for text in req.input]
        with deadline(self.limit(None)):
            outputs = await embed_all(
                llm,
                prompts,
                normalize=True,
                dimensions=req.dimensions,
                metrics=self.metrics,
                lora_request=adapter,
            )
        response = OllamaEmbedResponse(
            model=req.model,
            embeddings=[[float(x) for x in v] for v in vectors(outputs)],
            total_duration=int((time.monotonic() - start) * 1e9),
            load_duration=0,
            prompt_eval_count=sum(out.num_prompt_tokens for out in outputs),
        )
        return ASCIIJSONResponse(dump(response))

    async def embeddings(self, body: Any, big: bool) -> Response:
        """``/api/embeddings`` (the older route): one prompt, not normalised."""
        llm = self.slot.get()
        req = await maybe_off_loop(big, validate, OllamaEmbeddingsRequest, body)
        adapter = self.check_model_or_adapter(req.model)
        prompt = await parse_input(llm, req.prompt, field="prompt")
        with deadline(self.limit(None)):
            outputs = await embed_all(
                llm,
                [prompt],
                normalize=False,
                field="prompt",
                metrics=self.metrics,
                lora_request=adapter,
            )
        (vector,) = vectors(outputs)
        response = OllamaEmbeddingsResponse(embedding=[float(x) for x in vector])
        return ASCIIJSONResponse(dump(response))

    @staticmethod
    def version() -> OllamaVersion:
        return OllamaVersion(version=structllm.__version__)

    def _models(self) -> list[OllamaModel]:
        """The served model and its LoRA adapters, in the order they loaded."""
        loras = self.slot.loras
        adapters = [] if loras is None else loras.adapters()
        served = served_model(self.slot.get(), self.config.model_name, self.started)
        parent = self.config.model_name
        return [served, *(adapter_model(a, parent, self.started) for a in adapters)]

    # -- shared -----------------------------------------------------------------------

    async def _render(
        self,
        llm: AsyncLLM,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> Prompt:
        """``messages`` through the chat template, tokenised (as chat does)."""
        options = {"add_generation_prompt": True, "tools": tools}
        return await self.render_messages(llm, messages, options)

    def _check_fits(self, llm: AsyncLLM, options: Any, prompt: Prompt) -> None:
        max_tokens = options.max_tokens if options is not None else None
        self.check_length(llm, prompt.token_ids, max_tokens, "options.num_predict")
        num_ctx = options.num_ctx if options is not None else None
        if num_ctx is None:
            return
        if num_ctx > llm.max_model_len:
            raise InvalidRequestError(
                f"options.num_ctx: {num_ctx} is above this server's context of "
                f"{llm.max_model_len} tokens (--max-model-len)",
                field="options.num_ctx",
            )
        need = len(prompt.token_ids) + (max_tokens or 0)
        if need > num_ctx:
            raise InvalidRequestError(
                f"options.num_ctx: the prompt has {len(prompt.token_ids)} tokens"
                + (f" and num_predict is {max_tokens}" if max_tokens else "")
                + f"; that does not fit in {num_ctx}",
                field="options.num_ctx",
            )

    def _line(self, model: type[Any], name: str, **fields: Any) -> dict[str, Any]:
        """One answer line (``name``: the model it names, an adapter's when
        the request ran with one)."""
        done = "done_reason" in fields
        return dump(
            model(
                model=name,
                created_at=rfc3339(time.time()),
                done=done,
                **fields,
            )
        )

    def _loaded(self, model: type[Any], name: str, **fields: Any) -> Response:
        """Ollama's answer to a request that only loads the model."""
        return ASCIIJSONResponse(self._line(model, name, done_reason="load", **fields))

    async def _answer(
        self,
        llm: AsyncLLM,
        job: Job,
        streaming: bool,
        line: _Line,
        timing: Timing,
    ) -> Response:
        """The whole answer, or its NDJSON stream (refused first if it must be)."""

        async def on_output(out: RequestOutput) -> None:
            timing.saw_output()

        if not streaming:
            with renamed("format"):
                final = await self.observe(job, on_output)
            whole = line(final, True)
            assert whole is not None
            return ASCIIJSONResponse(whole)
        llm.check_admission(job.prompt.token_ids, count=1, params=job.params)
        limit = self.limit(None)  # --request-timeout, or X-Request-Timeout's

        async def produce(emit: Emit) -> None:
            async def send(out: RequestOutput) -> None:
                timing.saw_output()
                if out.outputs[0].text and (event := line(out, False)) is not None:
                    await emit(event)

            try:
                with deadline(limit), renamed("format"):
                    final = await self.observe(job, send)
                last = line(final, True)
                assert last is not None
                await emit(last)
            except Exception as exc:
                response = self.error_response(unwrap_group(exc))
                if response is None:
                    raise
                await emit(json.loads(bytes(ollama_error(response).body)))

        return NDJSONStream(produce)
