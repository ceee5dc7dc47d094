"""llama.cpp's native API on the engine: ``/completion``, ``/embedding``,
``/tokenize`` with ``content``, ``/detokenize``'s ``content``,
``/apply-template``, ``/props`` and ``/slots``.

A ``/completion`` prompt is tokenised as ``/v1/completions`` tokenises it
(with the special tokens: the BOS of a model that has one); in a list that
mixes ids and strings, each string after the first is tokenised without
them, as llama.cpp does. A list of prompts is answered with a list, one
object per prompt. A stream is server-sent events, one ``data:`` object per
piece of text (``content``, its ``tokens``, ``stop: false``) and a last one
with ``stop: true``, ``stop_type``, ``timings``, ``generation_settings``;
no ``[DONE]``, as llama.cpp. Errors are the OpenAI error bodies of the
other routes (``type``, ``param``, ``code``: llama.cpp's carry ``code``,
``message`` and ``type`` too).

``/slots`` is refused with llama.cpp's own 501 for a server started without
``--slots``: structllm schedules every request in one continuous batch, and
its ``/metrics`` report what it runs.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import attrs
from fastapi.responses import Response

import structllm
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.frontend.inputs import OFF_LOOP_CHARS, check_prompt_bytes
from structllm.errors import InvalidRequestError, unwrap_group
from structllm.lora_request import LoRARequest
from structllm.outputs import RequestOutput
from structllm.params import OutputKind, SamplingParams
from structllm.server.chat.messages import ChatPrompt
from structllm.server.embeddings.serving import embed_all, vectors
from structllm.server.http.body import maybe_off_loop, validate
from structllm.server.http.errors import ASCIIJSONResponse, json_error
from structllm.server.http.sse import Emit, EventStream, deadline
from structllm.server.llamacpp.answer import (
    Run,
    completion_constraint,
    completion_probabilities,
    pick_fields,
)
from structllm.server.llamacpp.protocol import (
    LlamaCompletionRequest,
    LlamaEmbeddingRequest,
    LlamaTimings,
    LlamaTokenizeRequest,
    LlamaTokenizeResponse,
)
from structllm.server.llamacpp.tokens import native_prompt, token_piece
from structllm.server.protocol.bodies import dump
from structllm.server.protocol.constraints import check_constraints, renamed
from structllm.server.serving import Job, Serving
from structllm.structured import StructuredOutputs

__all__ = ["LlamaCppServing"]


@attrs.define(eq=False)
class LlamaCppServing(Serving):
    """The native routes' logic."""

    # -- /completion -----------------------------------------------------------

    async def completion(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        req = await maybe_off_loop(big, validate, LlamaCompletionRequest, body)
        adapter = self.check_model_or_adapter(req.model)
        constraint, field = completion_constraint(req)
        if constraint is not None and field is not None:
            await check_constraints([(constraint, field)])
        params = self._params(llm, req, constraint)
        prompts = [
            await native_prompt(llm, p, i, len(req.prompts))
            for i, p in enumerate(req.prompts)
        ]
        for p in prompts:
            self.check_length(llm, p.token_ids, req.max_tokens, "n_predict")
        jobs = [
            Job(i, i, p, params, lora_request=adapter) for i, p in enumerate(prompts)
        ]
        if req.stream:
            if len(jobs) > 1:
                raise InvalidRequestError(
                    "stream: one prompt at a time when streaming", field="stream"
                )
            return self._stream(llm, req, jobs[0], field)
        runs: dict[int, Run] = {}

        async def one(job: Job) -> None:
            runs[job.index] = await self._run(job)

        with renamed(field):
            async with anyio.create_task_group() as tg:
                for job in jobs:
                    tg.start_soon(one, job)
        answers = [self._final(req, job, runs[job.index]) for job in jobs]
        if req.response_fields:
            answers = [pick_fields(a, req.response_fields) for a in answers]
        return ASCIIJSONResponse(answers if len(answers) > 1 else answers[0])

    def _params(
        self,
        llm: AsyncLLM,
        req: LlamaCompletionRequest,
        constraint: StructuredOutputs | None,
    ) -> SamplingParams:
        kw: dict[str, Any] = {}
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "top_k",
            "presence_penalty",
            "frequency_penalty",
            "ignore_eos",
        ):
            if (value := getattr(req, name)) is not None:
                kw[name] = value
        if req.seed is not None and req.seed != -1:
            kw["seed"] = req.seed
        if req.repeat_penalty is not None:
            kw["repetition_penalty"] = req.repeat_penalty
        if req.n_probs:
            kw["logprobs"] = req.n_probs
        bias: dict[int, float] = {}
        for key, value, field in req.bias_entries():
            if isinstance(key, str):
                ids = llm.tokenizer.encode(key, add_special_tokens=False)
            else:
                ids = [key]
            for t in ids:
                if t >= llm.vocab_size:
                    raise InvalidRequestError(
                        f"{field}: token id {t} is outside the vocabulary "
                        f"[0, {llm.vocab_size})",
                        field=field,
                    )
                bias[t] = value
        return SamplingParams(
            **kw,
            max_tokens=req.max_tokens,
            stop=req.stop,
            logit_bias=bias,
            output_kind=OutputKind.DELTA if req.stream else OutputKind.FINAL,
            structured_outputs=constraint,
        )

    async def embedding(self, body: Any, big: bool) -> Response:
        """``/embedding``: each prompt's pooled vector, in llama.cpp's shape."""
        llm = self.slot.get()
        req = await maybe_off_loop(big, validate, LlamaEmbeddingRequest, body)
        adapter = self.check_model_or_adapter(req.model)
        count = len(req.prompts)
        prompts = [
            await native_prompt(llm, p, i, count, "content")
            for i, p in enumerate(req.prompts)
        ]
        with deadline(self.limit(None)):
            outputs = await embed_all(
                llm,
                prompts,
                pooling=req.pooling,
                normalize=req.embd_normalize == 2,
                field="content",
                metrics=self.metrics,
                lora_request=adapter,
            )
        answer = [
            {"index": i, "embedding": [[float(x) for x in v]]}
            for i, v in enumerate(vectors(outputs))
        ]
        return ASCIIJSONResponse(answer)

    async def _run(self, job: Job) -> Run:
        start = time.monotonic()
        first: list[float] = []

        async def on_output(out: RequestOutput) -> None:
            if not first:
                first.append(time.monotonic())

        final = await self.observe(job, on_output)
        end = time.monotonic()
        return Run(final, start, first[0] if first else end, end)

    def _stream(
        self, llm: AsyncLLM, req: LlamaCompletionRequest, job: Job, field: str | None
    ) -> EventStream:
        llm.check_admission(job.prompt.token_ids, count=1, params=job.params)
        limit = self.limit(None)  # --request-timeout, or X-Request-Timeout's

        async def produce(emit: Emit) -> None:
            start = time.monotonic()
            first: list[float] = []

            async def send(out: RequestOutput) -> None:
                if not first:
                    first.append(time.monotonic())
                c = out.outputs[0]
                if not c.text and not c.token_ids:
                    return
                chunk: dict[str, Any] = {
                    "index": job.index,
                    "content": c.text,
                    "tokens": list(c.token_ids),
                    "stop": False,
                    "id_slot": -1,
                    "tokens_predicted": out.num_generated_tokens,
                    "tokens_evaluated": len(out.prompt_token_ids),
                }
                if req.n_probs:
                    chunk["completion_probabilities"] = completion_probabilities(
                        c, req.n_probs
                    )
                await emit(chunk)

            try:
                with deadline(limit), renamed(field):
                    final = await self.observe(job, send)
                end = time.monotonic()
                run = Run(final, start, first[0] if first else end, end)
                last = self._final(req, job, run, streamed=True)
                if req.response_fields:
                    last = pick_fields(last, req.response_fields)
                await emit(last)
            except Exception as exc:
                response = self.error_response(unwrap_group(exc))
                if response is None:
                    raise
                await emit(json.loads(bytes(response.body)))

        return EventStream(produce)

    def _final(
        self,
        req: LlamaCompletionRequest,
        job: Job,
        run: Run,
        *,
        streamed: bool = False,
    ) -> dict[str, Any]:
        """The answer of one prompt (or, streamed, its last event)."""
        out = run.final
        c = out.outputs[0]
        n_prompt = len(out.prompt_token_ids)
        cached = out.num_cached_tokens or 0
        n = len(c.token_ids)
        if c.finish_reason == "length":
            stop_type, word = "limit", ""
        elif isinstance(c.stop_reason, str):
            stop_type, word = "word", c.stop_reason
        else:
            stop_type, word = "eos", ""
        prompt_ms = (run.first - run.start) * 1e3
        predicted_ms = (run.end - run.first) * 1e3
        timings = LlamaTimings(
            cache_n=cached,
            prompt_n=n_prompt - cached,
            prompt_ms=prompt_ms,
            prompt_per_token_ms=prompt_ms / max(n_prompt - cached, 1),
            prompt_per_second=(n_prompt - cached) / max(prompt_ms / 1e3, 1e-9),
            predicted_n=n,
            predicted_ms=predicted_ms,
            predicted_per_token_ms=predicted_ms / max(n, 1),
            predicted_per_second=n / max(predicted_ms / 1e3, 1e-9),
        )
        answer: dict[str, Any] = {
            "index": job.index,
            "content": "" if streamed else c.text,
            "tokens": [] if streamed or not req.return_tokens else list(c.token_ids),
            "id_slot": -1,
            "stop": True,
            "model": self.served_name(job.lora_request),
            "tokens_predicted": n,
            "tokens_evaluated": n_prompt,
            "generation_settings": self._settings(job.params, job.lora_request),
            # the prompt's tokens, special ones spelled out (llama.cpp's "<s> ")
            "prompt": self.slot.get().tokenizer.decode(
                out.prompt_token_ids, skip_special_tokens=False
            ),
            "has_new_line": "\n" in c.text,
            "truncated": False,
            "stop_type": stop_type,
            "stopping_word": word,
            "tokens_cached": n_prompt + n,
            "timings": dump(timings),
        }
        if req.n_probs and not streamed:
            answer["completion_probabilities"] = completion_probabilities(
                c, req.n_probs
            )
        return answer

    def _settings(
        self, params: SamplingParams, adapter: LoRARequest | None = None
    ) -> dict[str, Any]:
        """``generation_settings``: the parameters a request ran with (and
        the model: its LoRA adapter's name when it ran with one)."""
        return {
            "n_predict": -1 if params.max_tokens is None else params.max_tokens,
            "seed": -1 if params.seed is None else params.seed,
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
            "min_p": params.min_p,
            "repeat_last_n": -1,
            "repeat_penalty": params.repetition_penalty,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
            "stop": list(params.stop),
            "ignore_eos": params.ignore_eos,
            "n_probs": params.logprobs or 0,
            "stream": params.output_kind == OutputKind.DELTA,
            "n_ctx": self.slot.get().max_model_len,
            "model": self.served_name(adapter),
        }

    # -- /tokenize, /props, /slots --------------------------------------------------

    async def tokenize(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        req = await maybe_off_loop(big, validate, LlamaTokenizeRequest, body)
        check_prompt_bytes(req.content, llm.max_prompt_bytes, "content")
        tok = llm.tokenizer

        def encode() -> list[int]:
            return tok.encode(req.content, add_special_tokens=req.add_special)

        if len(req.content) > OFF_LOOP_CHARS:
            ids = await anyio.to_thread.run_sync(encode)
        else:
            ids = encode()
        if not req.with_pieces:
            return ASCIIJSONResponse(dump(LlamaTokenizeResponse(tokens=ids)))
        pieces = [{"id": i, "piece": token_piece(llm, i)} for i in ids]
        return ASCIIJSONResponse({"tokens": pieces})

    async def apply_template(self, body: Any, big: bool) -> Response:
        """``/apply-template``: the messages rendered as chat completions
        renders them, not tokenised (``{"prompt": text}``)."""
        llm = self.slot.get()
        req = await maybe_off_loop(big, validate, ChatPrompt, body)
        messages = req.template_messages()
        check_prompt_bytes(
            "".join(m["content"] for m in messages), llm.max_prompt_bytes, "messages"
        )
        options = req.template_options()

        def render() -> str:
            return llm.tokenizer.apply_chat_template(messages, **options)

        size = sum(len(m["content"]) for m in messages)
        text = await maybe_off_loop(size > OFF_LOOP_CHARS, render)
        return ASCIIJSONResponse({"prompt": text})

    def props(self) -> dict[str, Any]:
        llm = self.slot.get()
        tok = llm.tokenizer
        defaults = self._settings(SamplingParams(max_tokens=None))
        return {
            "default_generation_settings": {
                "id": 0,
                "n_ctx": llm.max_model_len,
                "is_processing": False,
                "params": defaults,
            },
            "total_slots": llm.engine_config.max_num_seqs,
            "model_alias": self.config.model_name,
            "model_path": llm.engine_config.model,
            "chat_template": tok.chat_template or "",
            "bos_token": tok.bos_token or "",
            "eos_token": tok.eos_token or "",
            "modalities": {"vision": False, "audio": False},
            "build_info": f"structllm {structllm.__version__}",
        }

    def slots(self) -> Response:
        return json_error(
            501,
            "/slots is not available: structllm schedules every request in one "
            "continuous batch, not in slots; /metrics reports the requests "
            "running and waiting",
        )
