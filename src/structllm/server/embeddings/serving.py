"""``POST /v1/embeddings``: each input pooled from the model's last hidden states.

A request is validated as an
:class:`~structllm.server.embeddings.protocol.EmbeddingRequest`; each text
input is tokenised (off the event loop when long, under the prompt byte
cap), and every input becomes one engine request
(:meth:`AsyncLLM.embed <structllm.AsyncLLM.embed>`), all submitted at once
so the scheduler batches them like any prompts. Each is prefilled and
finished at the end of its prefill, its KV blocks freed. A client that
leaves, or the request's time limit, aborts every input still running (the
guard's cancel scope). The engine request ids are the HTTP request's,
``{X-Request-Id}-{serial}-{index}``, as for the other APIs.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
import attrs
from fastapi.responses import Response

from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.frontend.inputs import (
    OFF_LOOP_CHARS,
    Prompt,
    check_prompt_bytes,
    parse_prompt_off_loop,
)
from structllm.errors import InvalidRequestError, RequestFailedError, unwrap_group
from structllm.lora_request import LoRARequest
from structllm.outputs import EmbeddingOutput
from structllm.server.embeddings.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from structllm.server.http.access import current_record
from structllm.server.http.body import maybe_off_loop, validate
from structllm.server.http.errors import ASCIIJSONResponse
from structllm.server.http.sse import deadline
from structllm.server.metrics import Metrics
from structllm.server.protocol import bodies
from structllm.server.serving import Serving

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "EmbeddingServing",
    "embed_all",
    "encode_embedding",
    "parse_input",
    "vectors",
]


def encode_embedding(
    vector: npt.NDArray[np.float32], encoding_format: str
) -> list[float] | str:
    """``vector`` as JSON floats, or base64 of its little-endian float32 bytes
    (what OpenAI sends, and its client decodes with ``np.frombuffer``)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


@attrs.define(eq=False)
class EmbeddingServing(Serving):
    """The embeddings endpoint's logic (the route only calls ``create``)."""

    async def create(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()  # 503 while loading
        req: EmbeddingRequest = await maybe_off_loop(
            big, validate, EmbeddingRequest, body
        )
        adapter = self.check_model_or_adapter(req.model)
        prompts = [
            attrs.evolve(
                await parse_input(llm, p, req.add_special_tokens),
                cache_salt=req.cache_salt,
            )
            for p in req.input
        ]
        with deadline(self.limit(None)):
            outputs = await embed_all(
                llm,
                prompts,
                pooling=req.pooling,
                normalize=req.normalized,
                dimensions=req.dimensions,
                priority=req.priority or 0,
                metrics=self.metrics,
                lora_request=adapter,
            )
        data = [
            EmbeddingData(
                index=i, embedding=encode_embedding(vector, req.encoding_format)
            )
            for i, vector in enumerate(vectors(outputs))
        ]
        tokens = sum(out.num_prompt_tokens for out in outputs)
        response = EmbeddingResponse(
            id=bodies.new_id("embd"),
            created=bodies.now(),
            model=self.served_name(adapter),
            data=data,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )
        return ASCIIJSONResponse(bodies.dump(response))


def vectors(outputs: Sequence[EmbeddingOutput]) -> list[npt.NDArray[np.float32]]:
    """Each output's embedding (RequestFailedError if one was aborted)."""
    vectors = []
    for out in outputs:
        if out.embedding is None:  # aborted by the engine's own abort()
            raise RequestFailedError("the request was aborted before it finished")
        vectors.append(out.embedding)
    return vectors


async def parse_input(
    llm: AsyncLLM,
    prompt: str | Sequence[int],
    add_special_tokens: bool = True,
    field: str = "input",
) -> Prompt:
    """One input as a :class:`Prompt`: text tokenised (in a thread when
    long, under the byte cap), ids checked against the vocabulary."""
    if not isinstance(prompt, str):
        return Prompt(None, tuple(prompt))
    if add_special_tokens:  # as a completion prompt is tokenised
        return await parse_prompt_off_loop(
            prompt, llm.tokenizer, max_bytes=llm.max_prompt_bytes
        )
    check_prompt_bytes(prompt, llm.max_prompt_bytes, field)

    def encode() -> list[int]:
        return llm.tokenizer.encode(prompt, add_special_tokens=False)

    if len(prompt) > OFF_LOOP_CHARS:
        ids = await anyio.to_thread.run_sync(encode)
    else:
        ids = encode()
    if not ids:
        raise InvalidRequestError(f"{field} has no tokens", field=field)
    return Prompt(prompt, tuple(ids))


async def embed_all(
    llm: AsyncLLM,
    prompts: Sequence[Prompt],
    *,
    pooling: Any = None,
    normalize: bool | None = None,
    dimensions: int | None = None,
    priority: int = 0,
    field: str = "input",
    metrics: Metrics | None = None,
    lora_request: LoRARequest | None = None,
) -> list[EmbeddingOutput]:
    """Every prompt's embedding, in order, all submitted at once.

    Each is checked for admission first, so a prompt the model cannot
    take is a 400 naming ``field`` (``input[i]`` of several) and overload
    a 503 before any runs. One failing cancels the others; its error is
    raised as itself. ``metrics``: each finished input counts as a request
    (latency, queue time, prompt tokens; no generated tokens).
    ``lora_request``: the LoRA adapter the request's ``model`` named (its
    layers change the hidden states pooled).
    """
    for i, p in enumerate(prompts):
        name = field if len(prompts) == 1 else f"{field}[{i}]"
        n, context = len(p.token_ids), llm.max_model_len
        if n >= context:  # the core's words are about room to generate
            raise InvalidRequestError(
                f"{name} is too large: {n} tokens, and this model's context "
                f"takes at most {context - 1}; inputs are never truncated",
                field=name,
            )
        try:
            llm.check_admission(p.token_ids, count=len(prompts))
        except InvalidRequestError as exc:
            if exc.field != "prompt":
                raise
            raise InvalidRequestError(f"{name}: {exc}", field=name) from None
    record = current_record()
    outputs: list[EmbeddingOutput | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        start = time.monotonic()
        rid = None if record is None else record.engine_request_id(i)
        outputs[i] = out = await llm.embed(
            prompts[i],
            pooling=pooling,
            normalize=normalize,
            dimensions=dimensions,
            request_id=rid,
            priority=priority,
            lora_request=lora_request,
        )
        n = len(prompts[i].token_ids)
        if record is not None:
            record.finished(i, i, n, 0, out.finish_reason)
        if metrics is not None:
            metrics.e2e.observe(time.monotonic() - start)
            if out.queue_time is not None:
                metrics.queue.observe(out.queue_time)
            metrics.requests.labels(finished_reason=out.finish_reason).inc()
            metrics.prompt_tokens.inc(n)

    try:
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    except BaseExceptionGroup as group:
        raise unwrap_group(group) from None
    return [out for out in outputs if out is not None]
