"""``POST /v1/completions``: its request model and its response models."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    model_validator,
)
from pydantic_core import PydanticCustomError

from structllm.outputs import FinishReason
from structllm.params import SamplingParams
from structllm.server.protocol.bodies import Body, PerRequestMetrics, Usage
from structllm.server.protocol.fields import MAX_CHOICES, Logprobs, Prompts
from structllm.server.protocol.logprobs import (
    CompletionLogprobs,
    PromptLogprobs,
)
from structllm.server.protocol.refusals import CHAT_ONLY, COMPLETION_REFUSED
from structllm.server.protocol.sampling import SamplingRequest

__all__ = [
    "CompletionChoice",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamChoice",
    "CompletionStreamResponse",
]


class CompletionChoice(Body):
    """vLLM's choice: its own fields are ``null`` when not asked for."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    #: with ``return_token_ids`` (vLLM)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    #: with ``prompt_logprobs`` (vLLM)
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(Body):
    """``POST /v1/completions`` without ``stream``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage
    #: vLLM's per-request timings (--enable-per-request-metrics, one choice)
    metrics: PerRequestMetrics | None = None


class CompletionStreamChoice(Body):
    """vLLM's streamed choice: every field in every chunk, ``null`` included,
    except ``prompt_logprobs`` (vLLM does not stream them)."""

    _omit_unset = frozenset({"prompt_logprobs"})

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    #: set in the chunk that finishes the choice
    stop_reason: int | str | None = None
    #: with ``return_token_ids``: the prompt's in the choice's first chunk
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    #: with ``prompt_logprobs``, in the choice's first chunk that has tokens
    prompt_logprobs: PromptLogprobs | None = None


class CompletionStreamResponse(Body):
    """One ``data:`` event of a streaming ``POST /v1/completions``."""

    _omit_unset = frozenset({"usage", "metrics"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None
    #: in the closing usage chunk, as in a whole response
    metrics: PerRequestMetrics | None = None


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    refused_fields = COMPLETION_REFUSED
    prompt: Prompts
    logprobs: Logprobs | None = None

    @model_validator(mode="before")
    @classmethod
    def _chat_only(cls, data: Any) -> Any:
        for name, no_ops in CHAT_ONLY.items():
            value = data.get(name) if isinstance(data, dict) else None
            if value is not None and value not in no_ops:
                raise PydanticCustomError(
                    "refused",
                    "tool calling is only for chat completions",
                    {"name": name},
                )
        return data

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if len(self.prompt) * self.choices > MAX_CHOICES:
            raise PydanticCustomError(
                "prompt",
                f"prompts times n must not exceed {MAX_CHOICES}",
            )
        return self

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        kw = self._sampling_kwargs()
        kw["max_tokens"] = (
            default_max_tokens if self.max_tokens is None else (self.max_tokens)
        )
        kw["logprobs"] = self.logprobs
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            kw["prompt_logprobs"] = self.logprobs  # the echoed prompt's, as vLLM
        return SamplingParams(**kw)
