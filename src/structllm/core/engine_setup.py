"""What an engine core is built from: its model (or a rank's shard), the KV
cache's size, and the scheduler's limits.

:class:`~structllm.core.engine_core.EngineCore` builds itself from these, and
a tensor-parallel follower rank loads its shard with
:func:`load_engine_model`. Each refuses a setting that cannot work with the
loaded model with :class:`~structllm.errors.EngineConfigError` naming the
field. Paddle loads with the model only (imported inside
:func:`load_engine_model`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from structllm.config import EngineConfig
from structllm.core.scheduler import SchedulerConfig
from structllm.errors import EngineConfigError

if TYPE_CHECKING:
    from structllm.model.loader import LoadedModel, LoadProgress

__all__ = [
    "engine_scheduler_config",
    "kv_cache_touch_limit",
    "load_engine_model",
    "size_kv_cache",
]


def load_engine_model(
    config: EngineConfig,
    rank: int = 0,
    on_progress: Callable[[LoadProgress], None] | None = None,
) -> LoadedModel:
    """``config``'s model, or rank ``rank``'s shard of it (tensor parallel)."""
    common: dict[str, Any] = {
        "dtype": config.dtype,
        "load_format": config.load_format,
        "block_size": config.block_size,
        "max_model_len": config.max_model_len,
        "seed": config.seed,
        # LoRA's slots run in the eager backend only
        "backend": "eager"
        if config.enable_lora and config.model_backend == "auto"
        else config.model_backend,
        "quantization": config.quantization,
        "quantized_activations": config.quantized_activations,
        "on_progress": on_progress,
    }
    tp = config.tensor_parallel_size
    if tp == 1:
        from structllm.model.loader import load_model

        loaded = load_model(config.model, num_threads=config.cpu_threads(), **common)
    else:
        from structllm.model.parallel import load_model_shard

        loaded = load_model_shard(config.model, tp, rank, **common)
    loaded.model.set_kv_cache_dtype(config.kv_cache_dtype)
    return loaded


def size_kv_cache(config: EngineConfig, loaded: LoadedModel) -> tuple[int, int]:
    """``(max_model_len, num_blocks)`` for ``loaded`` under ``config``: the
    context within the model's, and the KV blocks (``num_blocks``, else as
    many as ``kv_cache_memory`` holds), at least one full-length sequence's."""
    limit = loaded.config.max_context_len
    if config.max_model_len is not None and config.max_model_len > limit:
        raise EngineConfigError(
            f"max_model_len ({config.max_model_len}) exceeds the model's "
            f"context ({limit}: max_position_embeddings, or yarn's extension)",
            field="max_model_len",
        )
    max_model_len = config.max_model_len or limit
    blocks_per_seq = math.ceil(max_model_len / config.block_size)
    num_blocks = config.num_blocks
    if num_blocks is None:
        per_block = loaded.model.kv_cache_bytes_per_block()
        # never more than every sequence at full length could use
        num_blocks = min(
            config.kv_cache_memory // per_block,
            config.max_num_seqs * blocks_per_seq,
        )
    if num_blocks < blocks_per_seq:
        raise EngineConfigError(
            f"the KV cache holds {num_blocks} blocks of {config.block_size} tokens, "
            f"fewer than one sequence of max_model_len={max_model_len} needs "
            f"({blocks_per_seq}); raise num_blocks/kv_cache_memory or lower "
            "max_model_len",
            field="num_blocks" if config.num_blocks is not None else "kv_cache_memory",
        )
    return max_model_len, num_blocks


def kv_cache_touch_limit(
    config: EngineConfig, loaded: LoadedModel, num_blocks: int
) -> int | None:
    """The pool's ``touch_limit`` for a cache of ``num_blocks``: the blocks
    ``kv_cache_memory`` holds, when fewer (else None, no limit).

    On CPU the cache's memory is committed as blocks are first used, and
    the block pool prefers a never-used block to evicting a cached prefix,
    so under ever-new prompts the prefix cache grows until every block is
    resident. Sized from ``kv_cache_memory`` (:func:`size_kv_cache`), the
    cache is within it anyway; sized by ``num_blocks`` beyond it, running
    sequences may still use every block, but cached prefixes are evicted
    rather than grow the resident cache past ``kv_cache_memory``.
    """
    limit = config.kv_cache_memory // loaded.model.kv_cache_bytes_per_block()
    return limit if limit < num_blocks else None


def engine_scheduler_config(
    config: EngineConfig, max_model_len: int
) -> SchedulerConfig:
    """The scheduler's limits from ``config`` (its speculation's too)."""
    spec = config.speculative_config
    try:
        return SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching,
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
            disable_by_batch_size=None if spec is None else spec.disable_by_batch_size,
            scheduling_order=config.scheduling_order,
            deadline_starvation_s=config.deadline_starvation_s,
        )
    except EngineConfigError:
        raise
    except ValueError as exc:  # an attrs validator: "'max_num_seqs' must be..."
        raise EngineConfigError(str(exc)) from exc
