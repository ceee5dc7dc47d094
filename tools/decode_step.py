"""The decode step the tools time: BATCH one-token sequences with CONTEXT
cached tokens each (random cache contents), as the engine would batch them.

Shared by tools/profile_step.py, tools/bench_kv_dtype.py and
tools/bench_tensor_parallel.py (run them as ``python tools/NAME.py``, which
puts this folder on the import path).
"""

from collections.abc import Sequence

import attrs
import numpy as np

from structllm.model._paddle import paddle
from structllm.model.attention import SequenceSlice
from structllm.model.llama import LlamaForCausalLM


@attrs.frozen
class DecodeStep:
    seqs: list[SequenceSlice]
    ids: paddle.Tensor  # (B,) int64
    positions: paddle.Tensor  # (B,) int64
    num_blocks: int  # a KV cache this many blocks long holds every sequence
    rng: np.random.Generator  # for the cache contents, after the ids

    def fill(self, caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]]) -> None:
        """Random keys and values, in each cache's own dtype."""
        for pair in caches:
            for t in pair:
                noise = self.rng.standard_normal(t.shape).astype(np.float32)
                paddle.assign(paddle.to_tensor(noise).astype(t.dtype), t)

    def run(
        self,
        model: LlamaForCausalLM,
        caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]],
    ) -> None:
        """One step: metadata, forward, logits on the host."""
        meta = model.attention.build_metadata(self.seqs)
        hidden = model.forward(self.ids, self.positions, caches, meta)
        model.compute_logits(hidden).numpy()


def decode_step(batch: int, context: int, block_size: int = 16) -> DecodeStep:
    per_seq = -(-(context + 1) // block_size)
    rng = np.random.default_rng(0)
    return DecodeStep(
        seqs=[
            SequenceSlice(context, 1, list(range(i * per_seq, (i + 1) * per_seq)))
            for i in range(batch)
        ],
        ids=paddle.to_tensor(rng.integers(0, 512, batch).astype(np.int64)),
        positions=paddle.to_tensor(np.full(batch, context, np.int64)),
        num_blocks=batch * per_seq + 1,
        rng=rng,
    )
