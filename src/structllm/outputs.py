"""What a request produces: :class:`RequestOutput` and its parts."""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["CompletionOutput", "FinishReason", "Logprob", "RequestOutput"]

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
