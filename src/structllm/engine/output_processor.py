"""Turns the core's token ids into :class:`RequestOutput` for one request.

Detokenises incrementally, finds stop strings (the caller then aborts the
request in the core), builds logprobs and honours ``output_kind``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from structllm.core.engine_core import RequestStepOutput
from structllm.model.sampler import TokenLogprobs
from structllm.outputs import CompletionOutput, FinishReason, Logprob, RequestOutput
from structllm.params import OutputKind, SamplingParams
from structllm.text.detokenizer import IncrementalDetokenizer
from structllm.text.tokenizer import Tokenizer

__all__ = ["RequestState", "merge_outputs"]


@attrs.define(eq=False)
class RequestState:
    """Front-end state of one live request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    tokenizer: Tokenizer
    detokenizer: IncrementalDetokenizer = attrs.field(init=False)
    token_ids: list[int] = attrs.Factory(list)
    logprobs: list[dict[int, Logprob]] | None = attrs.field(init=False)
    cumulative_logprob: float | None = attrs.field(init=False)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    queue_time: float | None = None
    num_cached_tokens: int | None = None
    #: how much text / how many tokens earlier delta outputs carried
    _sent_text: int = 0
    _sent_tokens: int = 0

    def __attrs_post_init__(self) -> None:
        self.detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            self.prompt_token_ids,
            skip_special_tokens=self.params.skip_special_tokens,
            stop=self.params.stop,
            include_stop_str_in_output=self.params.include_stop_str_in_output,
        )
        wants = self.params.logprobs is not None
        self.logprobs = [] if wants else None
        self.cumulative_logprob = 0.0 if wants else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, step: RequestStepOutput) -> RequestOutput | None:
        """Take one step's tokens; return what to deliver, if anything.

        When a stop string ends the text, the state finishes with reason
        ``stop`` although the core does not know yet: the caller must abort
        the request in the core (``self.finished`` tells it so).
        """
        if self.finished:
            return None
        self.token_ids.extend(step.new_token_ids)
        if step.queue_s is not None:
            self.queue_time = step.queue_s
        if step.num_cached_tokens is not None:
            self.num_cached_tokens = step.num_cached_tokens
        if self.logprobs is not None and step.logprobs is not None:
            for token, lp in zip(step.new_token_ids, step.logprobs, strict=True):
                self.logprobs.append(self._logprob_dict(token, lp))
                assert self.cumulative_logprob is not None
                self.cumulative_logprob += lp.sampled_logprob
        update = self.detokenizer.add_tokens(step.new_token_ids)
        if update.stop_str is not None:
            self.finish_reason, self.stop_reason = "stop", update.stop_str
        elif step.finish_reason is not None:
            self.detokenizer.finish()
            self.finish_reason, self.stop_reason = step.finish_reason, step.stop_reason
        return self.output()

    def abort(self, reason: FinishReason = "abort") -> RequestOutput:
        """Finish now (cancelled, or failed); return the final output."""
        if not self.finished:
            self.detokenizer.finish()
            self.finish_reason = reason
        out = self.output(force=True)
        assert out is not None
        return out

    def snapshot(self) -> RequestOutput:
        """Everything so far (cumulative), whatever the output kind."""
        out = self.output(force=True, kind=OutputKind.CUMULATIVE)
        assert out is not None
        return out

    def output(
        self, *, force: bool = False, kind: OutputKind | None = None
    ) -> RequestOutput | None:
        """The output to deliver now under ``params.output_kind``."""
        kind = kind or self.params.output_kind
        if kind is OutputKind.FINAL and not self.finished and not force:
            return None
        text = self.detokenizer.text
        tokens: Sequence[int] = self.token_ids
        logprobs = self.logprobs
        if kind is OutputKind.DELTA:
            text, tokens = text[self._sent_text :], tokens[self._sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[self._sent_tokens :]
            if not text and not tokens and not self.finished:
                return None
            self._sent_text += len(text)
            self._sent_tokens += len(tokens)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=(
                CompletionOutput(
                    text=text,
                    token_ids=tuple(tokens),
                    logprobs=None if logprobs is None else tuple(logprobs),
                    cumulative_logprob=self.cumulative_logprob,
                    finish_reason=self.finish_reason,
                    stop_reason=self.stop_reason,
                ),
            ),
            finished=self.finished,
            num_generated_tokens=len(self.token_ids),
            queue_time=self.queue_time,
            num_cached_tokens=self.num_cached_tokens,
        )

    def _logprob_dict(self, token: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        piece = self.tokenizer.id_to_piece
        d = {
            t: Logprob(v, rank, piece(t))
            for rank, (t, v) in enumerate(
                zip(lp.top_ids, lp.top_logprobs, strict=True), 1
            )
        }
        d[token] = Logprob(lp.sampled_logprob, lp.sampled_rank, piece(token))
        return d


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One delta output equal to ``older`` followed by ``newer``.

    Used when a consumer lags: pending deltas collapse into one item, so a
    slow reader costs memory in proportion to its own tokens only.
    """
    a, b = older.outputs[0], newer.outputs[0]
    logprobs = None
    if a.logprobs is not None and b.logprobs is not None:
        logprobs = a.logprobs + b.logprobs
    merged = attrs.evolve(
        b,
        text=a.text + b.text,
        token_ids=a.token_ids + b.token_ids,
        logprobs=logprobs,
    )
    return attrs.evolve(newer, outputs=(merged,))
