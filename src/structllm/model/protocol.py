"""What the loader, the tensor-parallel code and the core see of a model.

:class:`CausalLM` is the model layer's face to the rest: a step's forward
over the paged KV cache, the logits of chosen rows, and the cache's
allocation and size. ``LlamaForCausalLM`` (eager Paddle, the compiled CPU
kernels) and its oneDNN subclass are the implementations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from structllm.model._paddle import paddle
from structllm.model.attention import AttentionMetadata, PortableAttention
from structllm.model.config import ModelConfig

__all__ = ["CausalLM"]


class CausalLM(Protocol):
    """A decoder with its LM head; one ``forward`` computes a whole step."""

    #: the model this instance computes (a tensor-parallel rank's: its shard)
    config: ModelConfig
    #: builds each step's :class:`AttentionMetadata` (block tables, slots)
    attention: PortableAttention

    def forward(
        self,
        input_ids: paddle.Tensor,  # (T,) int64
        positions: paddle.Tensor,  # (T,) int64
        kv_caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]],
        meta: AttentionMetadata,
    ) -> paddle.Tensor:  # (T, H): what compute_logits takes
        """The step's hidden states; its keys and values written."""
        ...

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """float32 logits ``(N, V)`` of ``N`` rows of ``forward``'s output."""
        ...

    def set_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """How caches allocated from now on store keys and values (``auto``,
        ``float32``, ``float16``, ``bfloat16``); refuses, as an
        EngineConfigError, what cannot run."""
        ...

    def resolved_kv_cache_dtype(self) -> str:
        """The dtype caches allocated now hold (what ``auto`` means here)."""
        ...

    def allocate_kv_cache(
        self, num_blocks: int
    ) -> list[tuple[paddle.Tensor, paddle.Tensor]]:
        """Per layer K and V caches of ``num_blocks`` blocks."""
        ...

    def kv_cache_bytes_per_block(self) -> int:
        """What one block costs over every layer, K and V."""
        ...
