"""Turns a scheduler step into one model forward and one sampler call."""

from __future__ import annotations

import time
from collections.abc import Mapping

import attrs
import numpy as np

from structllm.core.scheduler import SchedulerOutput
from structllm.core.structured import StructuredOutputManager
from structllm.model._paddle import paddle
from structllm.model.attention import SequenceSlice
from structllm.model.llama import LlamaForCausalLM
from structllm.model.sampler import Sampler, SamplingRow, TokenLogprobs

__all__ = ["ModelRunner", "RunnerOutput"]


@attrs.frozen
class RunnerOutput:
    #: request id -> the token sampled for it (only chunks that sample)
    sampled: Mapping[str, int]
    logprobs: Mapping[str, TokenLogprobs]
    #: seconds in the model forward and logits (inputs built, outputs on host)
    forward_s: float
    sample_s: float


class ModelRunner:
    """Owns the model's KV cache; runs whole steps. ``structured`` (the
    core's grammar state) masks the constrained requests' logits."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        structured: StructuredOutputManager | None = None,
    ) -> None:
        self.model = model
        self.structured = structured
        self.num_blocks = num_blocks
        self.kv_caches = model.allocate_kv_cache(num_blocks)
        self.sampler = Sampler()

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        # one-token chunks first: the attention backend batches them
        chunks = sorted(step.chunks, key=lambda c: c.num_tokens > 1)
        ids: list[np.ndarray] = []
        positions: list[np.ndarray] = []
        seqs: list[SequenceSlice] = []
        rows: list[int] = []  # flattened row of each sampling chunk's last token
        sampling = []
        t = 0
        for c in chunks:
            req = c.request
            stop = c.context_len + c.num_tokens
            ids.append(np.asarray(req.token_slice(c.context_len, stop), dtype=np.int64))
            positions.append(np.arange(c.context_len, stop, dtype=np.int64))
            seqs.append(SequenceSlice(c.context_len, c.num_tokens, req.block_ids))
            t += c.num_tokens
            if c.samples:
                rows.append(t - 1)
                sampling.append(req)
        start = time.perf_counter()
        meta = self.model.attention.build_metadata(seqs)
        hidden = self.model.forward(
            paddle.to_tensor(np.concatenate(ids)),
            paddle.to_tensor(np.concatenate(positions)),
            self.kv_caches,
            meta,
        )  # (T, H)
        if not sampling:
            return RunnerOutput({}, {}, time.perf_counter() - start, 0.0)
        last = paddle.index_select(hidden, paddle.to_tensor(np.asarray(rows, np.int64)))
        logits = self.model.compute_logits(last).numpy()  # (N, V)
        forward_s = time.perf_counter() - start
        start = time.perf_counter()
        grammars = self.structured
        masks = None if grammars is None else grammars.fill_bitmask(sampling)
        out = self.sampler.sample(
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
            bitmask=None if masks is None else masks[0],
            bitmask_rows=None if masks is None else masks[1],
            overwrite=True,  # the logits are ours, fresh from the model
        )
        sampled = {
            r.request_id: int(tok)
            for r, tok in zip(sampling, out.token_ids, strict=True)
        }
        logprobs = {
            r.request_id: lp
            for r, lp in zip(sampling, out.logprobs, strict=True)
            if lp is not None
        }
        return RunnerOutput(sampled, logprobs, forward_s, time.perf_counter() - start)
