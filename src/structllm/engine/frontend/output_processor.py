"""Turns the core's token ids into :class:`RequestOutput`, for both front ends.

:class:`OutputProcessor` holds the :class:`RequestState` of every live
request, keyed by the id the core knows it by. ``process_outputs`` takes one
step's :class:`RequestStepOutput` list and returns what to deliver and which
requests to abort in the core (a stop string ends a request the core does
not know is finished; an output that fails to process fails its request
alone). The offline ``LLM`` reads the outputs it returns; ``AsyncLLM`` gives
each state a :class:`RequestOutputCollector`, a one-slot mailbox the
processor delivers into, so the router never blocks on a slow consumer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import attrs

from structllm.core.request import RequestStepOutput
from structllm.errors import RequestFailedError
from structllm.model.logprobs import TokenLogprobs
from structllm.outputs import CompletionOutput, FinishReason, Logprob, RequestOutput
from structllm.params import OutputKind, SamplingParams
from structllm.text.detokenizer import IncrementalDetokenizer
from structllm.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "OutputProcessor",
    "ProcessedOutputs",
    "RequestOutputCollector",
    "RequestState",
    "merge_choices",
    "merge_outputs",
]


@attrs.define(eq=False)
class RequestOutputCollector:
    """One request's mailbox: at most one pending output, merged when lagging.

    When the consumer lags, a new delta merges into the pending one; a
    cumulative or final output supersedes it. So a slow consumer costs
    memory in proportion to its own tokens and never blocks the producer.
    """

    output_kind: OutputKind
    #: the consumer's cancel scope (set by RequestStream); abort() cancels it
    scope: anyio.CancelScope | None = None
    error: BaseException | None = None
    #: no more outputs will be delivered (finished, aborted or failed)
    closed: bool = False
    _pending: RequestOutput | None = None
    _event: anyio.Event = attrs.Factory(anyio.Event)

    def deliver(self, out: RequestOutput) -> None:
        if self._pending is not None and self.output_kind is OutputKind.DELTA:
            out = merge_outputs(self._pending, out)
        self._pending = out
        self._event.set()

    def close(self, error: BaseException | None = None) -> None:
        self.closed = True
        if error is not None and self.error is None:
            self.error = error
        self._event.set()

    async def next(self) -> RequestOutput | None:
        """The next output, or None at the end; raises the request's error.

        Always a checkpoint (as trio expects of every async call), so a
        cancelled consumer stops here even when an output is ready: a
        checkpoint of its own when something is, else the wait for it (one
        pass through the event loop a token, not two).
        """
        if self._pending is not None or self.error is not None or self.closed:
            await anyio.lowlevel.checkpoint()
        while True:
            if self._pending is not None:
                out, self._pending = self._pending, None
                return out
            if self.error is not None:
                raise self.error
            if self.closed:
                await anyio.lowlevel.checkpoint_if_cancelled()
                return None
            await self._event.wait()
            self._event = anyio.Event()


@attrs.define(eq=False)
class RequestState:
    """Front-end state of one live request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    tokenizer: Tokenizer
    #: the id the core knows (AsyncLLM: unique per submission); default request_id
    core_id: str = attrs.field(
        default=attrs.Factory(lambda self: self.request_id, takes_self=True)
    )
    #: where outputs go (AsyncLLM); None: process_outputs returns them (LLM)
    queue: RequestOutputCollector | None = None
    detokenizer: IncrementalDetokenizer = attrs.field(init=False)
    token_ids: list[int] = attrs.Factory(list)
    logprobs: list[dict[int, Logprob]] | None = attrs.field(init=False)
    cumulative_logprob: float | None = attrs.field(init=False)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    queue_time: float | None = None
    num_cached_tokens: int | None = None
    prompt_logprobs: tuple[dict[int, Logprob] | None, ...] | None = None
    #: an embedding request's vector, once its prefill ends (read-only)
    embedding: npt.NDArray[np.float32] | None = None
    #: how much text / how many tokens earlier delta outputs carried
    _sent_text: int = 0
    _sent_tokens: int = 0
    _sent_prompt_logprobs: bool = False

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

    @property
    def mailbox(self) -> RequestOutputCollector:
        """The queue of a state that has one (every AsyncLLM request)."""
        if self.queue is None:
            raise RuntimeError(f"request {self.request_id!r} has no output queue")
        return self.queue

    def process(self, step: RequestStepOutput) -> RequestOutput | None:
        """Take one step's tokens; return what to deliver, if anything.

        When a stop string ends the text, the state finishes with reason
        ``stop`` although the core does not know yet: the caller must abort
        the request in the core (``self.finished`` tells it so).
        """
        if self.finished:
            return None
        # A step may bring several tokens (speculative decoding): a stop
        # string that ends the text at one of them ends the output there.
        update = self.detokenizer.add_tokens(step.new_token_ids)
        new_ids = step.new_token_ids[: update.num_taken]
        self.token_ids.extend(new_ids)
        if step.queue_s is not None:
            self.queue_time = step.queue_s
        if step.num_cached_tokens is not None:
            self.num_cached_tokens = step.num_cached_tokens
        if step.embedding is not None:
            import numpy as np  # embeddings only: a server that generates never loads it

            self.embedding = np.frombuffer(step.embedding, dtype="<f4")
        if step.prompt_logprobs is not None:
            self.prompt_logprobs = tuple(
                None if lp is None else self._logprob_dict(token, lp)
                for token, lp in zip(
                    self.prompt_token_ids, step.prompt_logprobs, strict=True
                )
            )
        if self.logprobs is not None and step.logprobs is not None:
            taken_logprobs = step.logprobs[: len(new_ids)]
            for token, lp in zip(new_ids, taken_logprobs, strict=True):
                self.logprobs.append(self._logprob_dict(token, lp))
                assert self.cumulative_logprob is not None
                self.cumulative_logprob += lp.sampled_logprob
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
        prompt_logprobs = self.prompt_logprobs
        if kind is OutputKind.DELTA:
            text, tokens = text[self._sent_text :], tokens[self._sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[self._sent_tokens :]
            if not text and not tokens and not self.finished:
                return None
            self._sent_text += len(text)
            self._sent_tokens += len(tokens)
            if self._sent_prompt_logprobs:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                self._sent_prompt_logprobs = True
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
            prompt_logprobs=prompt_logprobs,
            embedding=self.embedding,
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


@attrs.frozen
class ProcessedOutputs:
    """What one step's outputs mean for the front end."""

    #: outputs of states without a queue (those with one got theirs delivered)
    outputs: list[tuple[RequestState, RequestOutput]]
    #: states that finished or failed in this step, already dropped
    finished: list[RequestState]
    #: core ids to abort in the core: stop strings, failures, unknown ids
    to_abort: list[str]
    #: states that failed, each with its RequestFailedError (queues closed)
    failed: list[tuple[RequestState, RequestFailedError]]


@attrs.define(eq=False)
class OutputProcessor:
    """The live requests' output states, by core id and by the caller's id."""

    #: called whenever the last live request leaves
    on_idle: Callable[[], None] | None = None
    _states: dict[str, RequestState] = attrs.Factory(dict)
    _by_request: dict[str, RequestState] = attrs.Factory(dict)

    def __len__(self) -> int:
        return len(self._states)

    def add(self, state: RequestState) -> None:
        if state.core_id in self._states or state.request_id in self._by_request:
            raise ValueError(f"request {state.request_id!r} is already live")
        self._states[state.core_id] = state
        self._by_request[state.request_id] = state

    def get(self, request_id: str) -> RequestState | None:
        """The live request the caller calls ``request_id``."""
        return self._by_request.get(request_id)

    def pop(self, core_id: str) -> RequestState | None:
        """Drop the live request the core calls ``core_id``, if any."""
        state = self._states.pop(core_id, None)
        if state is not None:
            del self._by_request[state.request_id]
            if not self._states and self.on_idle is not None:
                self.on_idle()
        return state

    def release(self, state: RequestState) -> bool:
        """Its consumer is done with ``state``; True if the core must abort it.

        A request still live finishes as ``abort`` (its queue gets that
        final output, for a ``generate()`` consumer reading on) and leaves.
        """
        live = self._states.get(state.core_id) is state
        if live:
            out = state.abort()
            if state.queue is not None:
                state.queue.deliver(out)
            self.pop(state.core_id)
        if state.queue is not None:
            state.queue.close()
        return live

    def fail_all(self, make_error: Callable[[], BaseException]) -> None:
        """Finish every live request with ``error``, raising make_error() to each."""
        self.fail(list(self._states), make_error)

    def fail(
        self, core_ids: Iterable[str], make_error: Callable[[], BaseException]
    ) -> None:
        """Finish the live requests ``core_ids`` (those of one lost core) with
        an error, raising make_error() to each; ids no longer live are skipped."""
        for core_id in core_ids:
            state = self._states.get(core_id)
            if state is not None:
                state.abort("error")
                self.pop(core_id)
                if state.queue is not None:
                    state.queue.close(make_error())

    def process_outputs(
        self, step_outputs: Iterable[RequestStepOutput]
    ) -> ProcessedOutputs:
        """Take one step's outputs; never raises for one request's failure.

        Requests' first tokens are taken (and delivered) before the others'
        next ones: a delivery wakes its consumer, consumers run in the order
        they were woken (asyncio), and each formats and writes its chunk
        (0.1-1 ms). The core lists a step's newest requests last, so their
        first tokens would otherwise wait behind every running stream's
        write (docs/benchmarks.md, "Where time to first token goes").
        """
        result = ProcessedOutputs([], [], [], [])
        for step in sorted(step_outputs, key=self._has_output):
            state = self._states.get(step.request_id)
            if state is None:  # released already: make sure the core knows
                result.to_abort.append(step.request_id)
                continue
            try:
                out = state.process(step)
            except Exception as exc:  # e.g. detokenising: this request alone
                state.abort("error")
                failure = RequestFailedError(f"the request failed: {exc!r}")
                failure.__cause__ = exc
                self.pop(state.core_id)
                result.to_abort.append(state.core_id)
                result.finished.append(state)
                result.failed.append((state, failure))
                if state.queue is not None:
                    state.queue.close(failure)
                continue
            if state.finished:
                self.pop(state.core_id)
                result.finished.append(state)
                if step.finish_reason is None:  # a stop string: the core goes on
                    result.to_abort.append(state.core_id)
            if out is not None:
                if state.queue is not None:
                    state.queue.deliver(out)
                else:
                    result.outputs.append((state, out))
            if state.finished and state.queue is not None:
                state.queue.close()
        return result

    def _has_output(self, step: RequestStepOutput) -> bool:
        """False for a live request that has produced no token yet (a stable
        sort on this puts first tokens first)."""
        state = self._states.get(step.request_id)
        return state is None or bool(state.token_ids)


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
    prompt_logprobs = newer.prompt_logprobs or older.prompt_logprobs
    return attrs.evolve(newer, outputs=(merged,), prompt_logprobs=prompt_logprobs)


def merge_choices(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """The final outputs of one prompt's ``n`` samples as one output.

    ``outputs[i]`` is sample i's own request; the result is the first's, with
    every sample's ``CompletionOutput`` (``index`` i) and the tokens of all.
    """
    first = outputs[0]
    return attrs.evolve(
        first,
        outputs=tuple(
            attrs.evolve(out.outputs[0], index=i) for i, out in enumerate(outputs)
        ),
        finished=all(out.finished for out in outputs),
        num_generated_tokens=sum(out.num_generated_tokens for out in outputs),
    )
