"""``POST /v1/completions``: prompts in, choices out, whole or streamed.

A request is validated as a :class:`~structllm.server.completions.protocol.CompletionRequest`,
each text prompt is tokenised (off the event loop when long), and every
prompt times ``n`` becomes one engine request (a :class:`Job`); the
responses are :mod:`structllm.server.completions.protocol` models.
"""

from __future__ import annotations

from typing import Any

import attrs
from fastapi.responses import Response

from structllm.engine.frontend.inputs import Prompt, parse_prompt_off_loop
from structllm.outputs import RequestOutput
from structllm.server.completions.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
)
from structllm.server.http.body import maybe_off_loop, validate
from structllm.server.http.errors import ASCIIJSONResponse
from structllm.server.http.sse import deadline
from structllm.server.protocol import bodies
from structllm.server.protocol import logprobs as lp
from structllm.server.protocol.constraints import check_constraints, renamed
from structllm.server.protocol.logprobs import CompletionLogprobs, completion_logprobs
from structllm.server.serving import Chunks, Job, Serving

__all__ = ["CompletionServing"]


@attrs.define(eq=False)
class CompletionServing(Serving):
    """The completions endpoint's logic (the route only calls ``create``)."""

    async def create(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()  # 503 while loading, before anything streams
        req = await maybe_off_loop(big, validate, CompletionRequest, body)
        adapter = self.check_model_or_adapter(req.model)
        timed = self.wants_metrics(req.include_metrics)
        await check_constraints(req.constraint_checks)
        params = req.to_sampling_params(self.config.default_max_tokens)
        prompts = []
        for p in req.prompt:
            if isinstance(p, str):
                prompt = await parse_prompt_off_loop(
                    p, llm.tokenizer, max_bytes=llm.max_prompt_bytes
                )
            else:
                prompt = Prompt(None, p)
            self.check_length(llm, prompt.token_ids, req.max_tokens, req.limit_field)
            prompts.append(attrs.evolve(prompt, cache_salt=req.cache_salt))
        jobs = [
            Job(
                i * req.choices + j,
                i,
                p,
                params.for_choice(j),
                req.priority or 0,
                lora_request=adapter,
            )
            for i, p in enumerate(prompts)
            for j in range(req.choices)
        ]
        if req.stream:
            with renamed(req.constraint_field):
                chunks = _Chunks(self, req, bodies.new_id("cmpl"), adapter=adapter)
                return self.stream(
                    llm, jobs, chunks, req.constraint_field, req.timeout, timed
                )
        with renamed(req.constraint_field), deadline(self.limit(req.timeout)):
            finals = await self.run_to_end(jobs)
        by_index = {job.index: job for job in jobs}
        response = CompletionResponse(
            **self.head(bodies.new_id("cmpl"), adapter),
            choices=[self._choice(req, by_index[i], finals[i]) for i in sorted(finals)],
            usage=self.final_usage(jobs, finals),
            metrics=self.request_metrics(jobs) if timed else None,
        )
        return ASCIIJSONResponse(bodies.dump(response))

    def _choice(
        self, req: CompletionRequest, job: Job, out: RequestOutput
    ) -> CompletionChoice:
        c = out.outputs[0]
        extra: dict[str, Any] = {}
        if req.return_token_ids:
            extra["prompt_token_ids"] = list(job.prompt.token_ids)
            extra["token_ids"] = list(c.token_ids)
        if out.prompt_logprobs is not None:
            extra["prompt_logprobs"] = lp.prompt_logprobs(out)
        return CompletionChoice(
            index=job.index,
            text=(self.prompt_text(job.prompt) + c.text) if req.echo else c.text,
            logprobs=_logprobs(self, req, job, out),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            **extra,
        )


def _logprobs(
    serving: Serving,
    req: CompletionRequest,
    job: Job,
    out: RequestOutput,
    text_offset: int = 0,
) -> CompletionLogprobs | None:
    """``out``'s logprobs; echoed, the prompt's first when ``out`` has them."""
    c = out.outputs[0]
    as_ids = bool(req.return_tokens_as_token_ids)
    if not req.echo or out.prompt_logprobs is None:
        return completion_logprobs(c, text_offset, as_ids=as_ids)
    first = serving.slot.get().tokenizer.id_to_piece(job.prompt.token_ids[0])
    return completion_logprobs(
        c, text_offset, as_ids=as_ids, echo=out, first_piece=first
    )


@attrs.frozen
class _Chunks(Chunks[CompletionRequest]):
    """The chunks of a streaming completion (a StreamFormat)."""

    #: each choice's next logprobs text_offset, by choice index
    offsets: dict[int, int] = attrs.field(factory=dict)
    #: the choices whose prompt_token_ids have been sent
    sent_prompt_ids: set[int] = attrs.field(factory=set)

    def _chunk(
        self, choices: list[CompletionStreamChoice], usage: bodies.Usage | None
    ) -> CompletionStreamResponse:
        return CompletionStreamResponse(**self.head(usage), choices=choices)

    def opening(
        self, job: Job, usage: bodies.Usage | None
    ) -> CompletionStreamResponse | None:
        """The echoed prompt and its token ids, before any generated token.

        Without an echo there is no opening chunk: as in vLLM, the prompt's
        token ids go with the first generated token.
        """
        if not self.req.echo or self.req.logprobs is not None:
            # with logprobs, the prompt goes with its logprobs (first delta)
            return None
        extra: dict[str, Any] = {"text": self.serving.prompt_text(job.prompt)}
        if self.req.return_token_ids:
            extra["prompt_token_ids"] = list(job.prompt.token_ids)
            self.sent_prompt_ids.add(job.index)
        first = CompletionStreamChoice(
            index=job.index, logprobs=None, finish_reason=None, **extra
        )
        return self._chunk([first], usage)

    def delta(
        self, job: Job, out: RequestOutput, usage: bodies.Usage | None
    ) -> CompletionStreamResponse:
        c = out.outputs[0]
        text = c.text
        extra = self.finish_fields(c)
        if self.req.return_token_ids and job.index not in self.sent_prompt_ids:
            extra["prompt_token_ids"] = list(job.prompt.token_ids)
            self.sent_prompt_ids.add(job.index)
        if out.prompt_logprobs is not None:  # the first output (DELTA)
            extra["prompt_logprobs"] = lp.prompt_logprobs(out)
            if self.req.echo and self.req.logprobs is not None:
                text = self.serving.prompt_text(job.prompt) + text
        offset = self.offsets.get(job.index, 0)
        logprobs = _logprobs(self.serving, self.req, job, out, offset)
        if logprobs is not None and c.logprobs:  # offsets go on from the last
            last = c.logprobs[-1][c.token_ids[-1]].decoded_token or ""
            self.offsets[job.index] = logprobs.text_offset[-1] + len(last)
        choice = CompletionStreamChoice(
            index=job.index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            **extra,
        )
        return self._chunk([choice], usage)

    def delta_event(
        self, job: Job, out: RequestOutput, usage: bodies.Usage | None
    ) -> dict[str, Any]:
        """:meth:`delta`'s JSON object, built directly for a plain chunk (no
        logprobs, no usage, no prompt logprobs: most chunks of most streams).

        The same object as ``bodies.dump(self.delta(...))``, keys in the
        same order; building and dumping the pydantic models took ~20 us a
        token, on the core's CPUs when the server shares them.
        """
        c = out.outputs[0]
        if (
            usage is not None
            or c.logprobs is not None
            or out.prompt_logprobs is not None
        ):
            return bodies.dump(self.delta(job, out, usage))
        finished = c.finish_reason is not None
        choice: dict[str, Any] = {
            "index": job.index,
            "text": c.text,
            "logprobs": None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason if finished else None,
            "prompt_token_ids": None,
            "token_ids": None,
        }
        if self.req.return_token_ids:
            if job.index not in self.sent_prompt_ids:
                choice["prompt_token_ids"] = list(job.prompt.token_ids)
                self.sent_prompt_ids.add(job.index)
            choice["token_ids"] = list(c.token_ids)
        return self.plain_chunk("text_completion", choice)

    def closing(
        self, usage: bodies.Usage, metrics: bodies.PerRequestMetrics | None
    ) -> CompletionStreamResponse:
        extra: dict[str, Any] = {} if metrics is None else {"metrics": metrics}
        return CompletionStreamResponse(**self.head(usage), choices=[], **extra)
