"""``LLM``: the synchronous, offline batch API.

    llm = LLM("tiny")
    outputs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=32))

The engine core runs in this thread; ``generate`` returns when every prompt
has finished, outputs in input order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from structllm.core.engine_core import EngineConfig, EngineCore
from structllm.core.request import CoreRequest
from structllm.engine.inputs import PromptInput, is_batch, parse_prompt
from structllm.engine.output_processor import RequestState
from structllm.errors import InvalidRequestError
from structllm.model.loader import LoadProgress
from structllm.outputs import RequestOutput
from structllm.params import OutputKind, SamplingParams
from structllm.text.tokenizer import Tokenizer, load_tokenizer

__all__ = ["LLM"]


def progress_bar(desc: str, *, disable: bool = False) -> Callable[[LoadProgress], None]:
    """A load-progress callback that draws a tqdm bar and closes it at the end."""
    bar: tqdm[Any] | None = None

    def on_progress(event: LoadProgress) -> None:
        nonlocal bar
        if disable:
            return
        if bar is None:
            bar = tqdm(total=event.total, desc=f"{desc} {event.stage}", unit="tensor")
        bar.update(event.done - bar.n)
        if event.done >= event.total:
            bar.close()

    return on_progress


class LLM:
    """Offline generation over a batch of prompts with continuous batching.

    ``engine_args`` are the fields of :class:`EngineConfig` (``max_model_len``,
    ``num_blocks``, ``max_num_seqs``, ...). ``tokenizer`` defaults to the
    model directory (or the byte tokenizer for ``"tiny"``).
    """

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        show_progress: bool = True,
        **engine_args: Any,
    ) -> None:
        self.config = EngineConfig(model=str(model), **engine_args)
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer or self.config.model)
        self.core = EngineCore(
            self.config, on_progress=progress_bar("loading", disable=not show_progress)
        )
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            self.core.model_config.eos_token_ids
        )
        self._counter = itertools.count()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in the order of ``prompts``.

        ``prompts`` is one prompt or a list; a prompt is a string, a list of
        token ids, or a ``{"prompt_token_ids": [...]}`` dict. ``params`` is
        one SamplingParams for all, or one per prompt.
        """
        batch: list[PromptInput] = (
            list(prompts)  # type: ignore[arg-type]
            if is_batch(prompts)
            else [prompts]  # type: ignore[list-item]
        )
        if params is None:
            params = SamplingParams()
        plist = (
            [params] * len(batch)
            if isinstance(params, SamplingParams)
            else list(params)
        )
        if len(plist) != len(batch):
            raise InvalidRequestError(
                f"got {len(plist)} SamplingParams for {len(batch)} prompts",
                field="params",
            )
        if priority is not None and len(priority) != len(batch):
            raise InvalidRequestError(
                f"got {len(priority)} priorities for {len(batch)} prompts",
                field="priority",
            )
        # Tokenise and validate everything before the core sees any request.
        states: dict[str, RequestState] = {}
        order: list[str] = []
        requests: list[CoreRequest] = []
        for i, (prompt, p) in enumerate(zip(batch, plist, strict=True)):
            parsed = parse_prompt(prompt, self.tokenizer)
            rid = str(next(self._counter))
            p = p if p.output_kind is OutputKind.FINAL else _final(p)
            states[rid] = RequestState(
                rid, parsed.text, parsed.token_ids, p, self.tokenizer
            )
            order.append(rid)
            requests.append(
                CoreRequest(
                    request_id=rid,
                    prompt_token_ids=parsed.token_ids,
                    params=p,
                    eos_token_ids=self.eos_token_ids,
                    priority=0 if priority is None else priority[i],
                )
            )
        try:
            for r in requests:
                self.core.add_request(r)
            return self._run(states, order, use_tqdm)
        finally:
            # an exception (or KeyboardInterrupt) mid-run leaves nothing behind
            self.core.abort_requests(order)

    def _run(
        self, states: dict[str, RequestState], order: list[str], use_tqdm: bool
    ) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(
            total=len(order), desc="generating", unit="req", disable=not use_tqdm
        ) as bar:
            while len(results) < len(order):
                step = self.core.step()
                for out in step.outputs:
                    state = states[out.request_id]
                    final = state.process(out)
                    if state.finished:
                        if out.finish_reason is None:  # a stop string
                            self.core.abort_requests([out.request_id])
                        assert final is not None
                        results[out.request_id] = final
                        bar.update(1)
        return [results[rid] for rid in order]


def _final(p: SamplingParams) -> SamplingParams:
    import attrs

    return attrs.evolve(p, output_kind=OutputKind.FINAL)
