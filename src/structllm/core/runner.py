"""Turns a scheduler step into one model forward and one sampler call."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import attrs
import msgspec
import numpy as np

from structllm.core.lora_manager import LoRAManager
from structllm.core.request import Request
from structllm.core.scheduler import SchedulerOutput
from structllm.core.structured import StructuredOutputManager
from structllm.model._paddle import eager_mode_here, host_tensor, paddle
from structllm.model.attention import SequenceSlice
from structllm.model.protocol import CausalLM
from structllm.model.sampler import (
    Sampler,
    SamplingRow,
    TokenLogprobs,
    token_logprobs,
)

__all__ = [
    "PROMPT_LOGITS_ROWS",
    "ModelInput",
    "ModelRunner",
    "RunnerOutput",
    "run_forward",
]

#: prompt logprobs take logits this many positions at a time, so a long
#: chunk never holds more than (PROMPT_LOGITS_ROWS, vocab) floats at once
PROMPT_LOGITS_ROWS = 256


class ModelInput(msgspec.Struct, frozen=True, array_like=True):
    """One step's model forward: what every rank of a tensor-parallel group
    runs (rank 0 builds it and sends it to the others, which need nothing
    else: no scheduler, no requests, no sampling)."""

    #: (T,) int64 token ids and their positions, native byte order
    token_ids: bytes
    positions: bytes
    #: per sequence, ``(context_len, query_len, block_table)``
    seqs: tuple[tuple[int, int, tuple[int, ...]], ...]


def run_forward(
    model: CausalLM,
    kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]],
    step: ModelInput,
) -> paddle.Tensor:
    """The step's hidden states ``(T, H)``, its keys and values written."""
    eager_mode_here()  # the step may run on a thread that has not used Paddle
    meta = model.attention.build_metadata(
        [SequenceSlice(c, n, table) for c, n, table in step.seqs]
    )
    return model.forward(
        host_tensor(np.frombuffer(step.token_ids, dtype=np.int64)),
        host_tensor(np.frombuffer(step.positions, dtype=np.int64)),
        kv_caches,
        meta,
    )


@attrs.frozen
class RunnerOutput:
    #: request id -> the tokens sampled for it (only chunks that sample):
    #: its accepted proposals, then the model's own token
    sampled: Mapping[str, tuple[int, ...]]
    #: one entry per sampled token
    logprobs: Mapping[str, tuple[TokenLogprobs, ...]]
    #: request id -> (first prompt token covered, the entries of that token
    #: and those after it): prompt logprobs from this step's chunk
    prompt_logprobs: Mapping[str, tuple[int, list[TokenLogprobs]]]
    #: seconds in the model forward and logits (inputs built, outputs on host)
    forward_s: float
    sample_s: float
    #: pooling requests: request id -> (first position, stop, rows) where
    #: rows is the float64 sum of the hidden rows of positions [first, stop)
    #: (mean pooling, every chunk) or the last position's row (last
    #: pooling, its final chunk), shape (H,)
    pooled: Mapping[str, tuple[int, int, np.ndarray]] = attrs.field(factory=dict)


class ModelRunner:
    """Owns the model's KV cache; runs whole steps. ``structured`` (the
    core's grammar state) masks the constrained requests' logits.

    ``broadcast`` (rank 0 of a tensor-parallel group) is given each step's
    :class:`ModelInput` before the forward, so the other ranks run the same
    forward with it (their all-reduces meet this one's).

    ``lora`` (LoRA enabled): each sequence's rows run with its request's
    adapter, set on the model before the forward."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        structured: StructuredOutputManager | None = None,
        broadcast: Callable[[ModelInput], None] | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.structured = structured
        self.broadcast = broadcast
        self.num_blocks = num_blocks
        self.kv_caches = model.allocate_kv_cache(num_blocks)
        self.sampler = Sampler()

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        # one-token chunks first: the attention backend batches them
        chunks = sorted(step.chunks, key=lambda c: c.num_tokens > 1)
        ids: list[np.ndarray] = []
        positions: list[np.ndarray] = []
        seqs: list[tuple[int, int, tuple[int, ...]]] = []
        # flattened rows of each sampling chunk's last token and its proposals
        rows: list[int] = []
        sampling = []
        drafts: list[tuple[int, ...]] = []
        # prompt logprobs: (request, first flattened row, first position, count)
        prompt_rows: list[tuple[Request, int, int, int]] = []
        # pooling: (request, first flattened row, first position, count)
        pool_rows: list[tuple[Request, int, int, int]] = []
        t = 0
        for c in chunks:
            req = c.request
            stop = c.context_len + c.num_tokens
            own = stop - len(c.draft_token_ids)  # proposals follow the chunk's own
            tokens = req.token_slice(c.context_len, own)
            if c.draft_token_ids:
                tokens = [*tokens, *c.draft_token_ids]
            ids.append(np.asarray(tokens, dtype=np.int64))
            positions.append(np.arange(c.context_len, stop, dtype=np.int64))
            seqs.append((c.context_len, c.num_tokens, tuple(req.block_ids)))
            if req.needs_prompt_logits:
                # position i's logits give prompt token i + 1's logprob
                lo = max(c.context_len, len(req.prompt_logprobs))
                hi = min(stop, len(req.prompt_token_ids) - 1)
                if lo < hi:
                    prompt_rows.append((req, t + lo - c.context_len, lo, hi - lo))
            if req.pooling is not None:
                if req.pooling.method == "mean":  # positions not summed yet
                    lo = max(c.context_len, req.num_pooled)
                    if lo < stop:
                        pool_rows.append((req, t + lo - c.context_len, lo, stop - lo))
                elif c.samples:  # the last position
                    pool_rows.append((req, t + c.num_tokens - 1, stop - 1, 1))
                t += c.num_tokens
                continue  # nothing to sample
            t += c.num_tokens
            if c.samples:
                rows.extend(range(t - 1 - len(c.draft_token_ids), t))
                sampling.append(req)
                drafts.append(c.draft_token_ids)
        start = time.perf_counter()
        model_input = ModelInput(
            np.concatenate(ids).tobytes(),
            np.concatenate(positions).tobytes(),
            tuple(seqs),
        )
        if self.broadcast is not None:
            self.broadcast(model_input)
        if self.lora is not None:
            slots = self.lora.rows([c.request.lora_id for c in chunks])
            self.lora.slots.set_rows(
                None
                if slots is None
                else np.repeat(np.asarray(slots, np.int64), [n for _, n, _ in seqs])
            )
        hidden = run_forward(self.model, self.kv_caches, model_input)  # (T, H)
        prompt = {
            req.request_id: (pos + 1, self._prompt_logprobs(hidden, req, row, pos, n))
            for req, row, pos, n in prompt_rows
        }
        pooled = {
            req.request_id: (pos, pos + n, _sum_rows(hidden, row, n))
            for req, row, pos, n in pool_rows
        }
        if not sampling:
            return RunnerOutput(
                {}, {}, prompt, time.perf_counter() - start, 0.0, pooled
            )
        if len(rows) == hidden.shape[0]:  # every row samples (rows ascend)
            last = hidden
        else:
            last = paddle.index_select(hidden, host_tensor(np.asarray(rows, np.int64)))
        logits = self.model.compute_logits(last).numpy()  # (rows, V)
        forward_s = time.perf_counter() - start
        start = time.perf_counter()
        grammars = self.structured
        # constrained requests: a mask per position, proposals' included
        masks = None if grammars is None else grammars.fill_bitmask(sampling, drafts)
        out = self.sampler.verify(
            logits,
            [
                SamplingRow(
                    params=r.params,
                    generator=r.generator,
                    prompt_token_ids=r.prompt_token_ids,
                    output_token_ids=r.output_token_ids,
                    eos_token_ids=r.eos_token_ids,
                )
                for r in sampling
            ],
            drafts,
            bitmask=None if masks is None else masks[0],
            bitmask_rows=None if masks is None else masks[1],
            overwrite=True,  # the logits are ours, fresh from the model
        )
        sampled = {
            r.request_id: toks for r, toks in zip(sampling, out.token_ids, strict=True)
        }
        logprobs = {
            r.request_id: lp
            for r, lp in zip(sampling, out.logprobs, strict=True)
            if lp is not None
        }
        return RunnerOutput(
            sampled, logprobs, prompt, forward_s, time.perf_counter() - start, pooled
        )

    def _prompt_logprobs(
        self, hidden: paddle.Tensor, req: Request, row: int, pos: int, n: int
    ) -> list[TokenLogprobs]:
        """Entries of prompt tokens pos + 1 .. pos + n, from the logits of
        the ``n`` hidden rows from ``row`` (raw: nothing of sampling applies)."""
        k = req.params.prompt_logprobs or 0
        out: list[TokenLogprobs] = []
        for a in range(0, n, PROMPT_LOGITS_ROWS):
            b = min(n, a + PROMPT_LOGITS_ROWS)
            x = self.model.compute_logits(hidden[row + a : row + b]).numpy()  # (b-a, V)
            targets = req.prompt_token_ids[pos + a + 1 : pos + b + 1]
            out += token_logprobs(x, targets, [k] * (b - a))
        return out


def _sum_rows(hidden: paddle.Tensor, row: int, n: int) -> np.ndarray:
    """The float64 sum of ``n`` hidden rows from ``row``: (H,)."""
    total = np.zeros(hidden.shape[-1], dtype=np.float64)
    for a in range(0, n, PROMPT_LOGITS_ROWS):  # bounded copies of a long chunk
        b = min(n, a + PROMPT_LOGITS_ROWS)
        total += hidden[row + a : row + b].numpy().sum(axis=0, dtype=np.float64)
    return total
