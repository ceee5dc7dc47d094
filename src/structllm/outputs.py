"""What a request produces: :class:`RequestOutput` and its parts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import attrs

if TYPE_CHECKING:  # numpy is not imported for the annotations alone
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "FinishReason",
    "Logprob",
    "RequestOutput",
]

#: Why a request stopped generating. ``stop``: an EOS token, a stop token or
#: a stop string; ``length``: ``max_tokens`` or the context length;
#: ``abort``: cancelled by its consumer or by ``abort()``; ``error``: it
#: failed (the error itself is raised to the consumer).
FinishReason = Literal["stop", "length", "abort", "error"]


@attrs.frozen
class Logprob:
    """The log-probability of one token, with its rank in the distribution."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@attrs.frozen(kw_only=True)
class CompletionOutput:
    """The generated part of a request (one sample)."""

    index: int = 0
    text: str
    token_ids: tuple[int, ...]
    #: per generated token: token id -> Logprob (the sampled token and the top-n)
    logprobs: tuple[dict[int, Logprob], ...] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    #: the stop string or stop token id that ended the request, if any
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen(kw_only=True)
class RequestOutput:
    """One update for one request, as streamed to its consumer."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    #: tokens generated so far, counting those not in this (delta) output
    num_generated_tokens: int = 0
    #: seconds from arrival in the engine core to first being scheduled
    queue_time: float | None = None
    #: prompt tokens whose KV came from the prefix cache (once scheduled)
    num_cached_tokens: int | None = None
    #: with ``SamplingParams.prompt_logprobs``, once the prompt is computed:
    #: per prompt token, token id -> Logprob (that token and the top-n at its
    #: position); the first is None. In DELTA mode only on the first output
    #: that has them, as vLLM does.
    prompt_logprobs: tuple[dict[int, Logprob] | None, ...] | None = None
    #: an embedding request's vector (D,) float32, read-only, on its final
    #: output (see :class:`EmbeddingOutput`); None for generation
    embedding: npt.NDArray[np.float32] | None = attrs.field(default=None, eq=False)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@attrs.frozen(kw_only=True)
class EmbeddingOutput:
    """An embedding request's result (``LLM.embed``, ``AsyncLLM.embed``).

    ``embedding`` is the pooled last hidden state, (D,) float32 and
    read-only: D is the model's hidden size, or the ``dimensions`` asked
    for. A request aborted before its prefill ended has none
    (``finish_reason`` ``"abort"``).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    embedding: npt.NDArray[np.float32] | None = attrs.field(eq=False)
    finish_reason: FinishReason
    #: seconds from arrival in the engine core to first being scheduled
    queue_time: float | None = None
    #: prompt tokens whose KV came from the prefix cache
    num_cached_tokens: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @classmethod
    def from_request_output(cls, out: RequestOutput) -> EmbeddingOutput:
        """The embedding of an embedding request's final (or last) output."""
        return cls(
            request_id=out.request_id,
            prompt=out.prompt,
            prompt_token_ids=out.prompt_token_ids,
            embedding=out.embedding,
            finish_reason=out.finish_reason
            or ("stop" if out.embedding is not None else "abort"),
            queue_time=out.queue_time,
            num_cached_tokens=out.num_cached_tokens,
        )
