"""The KV cache's memory is committed as its blocks are used, not at start.

A CPU cache is a lazily committed mapping (``attention.lazy_zeros``): what
the process holds resident follows the blocks written, and a block the
step does not own is never read, whatever it holds.
"""

from __future__ import annotations

import gc

import attrs
import numpy as np
import pytest

from structllm.config import EngineConfig
from structllm.core.block_pool import BlockPool
from structllm.core.engine_setup import (
    kv_cache_touch_limit,
    load_engine_model,
    size_kv_cache,
)
from structllm.model._paddle import paddle
from structllm.model.attention import SequenceSlice, lazy_zeros
from structllm.model.config import tiny_random_config
from structllm.model.llama import LlamaForCausalLM
from structllm.model.loader import build_model, random_hf_tensors

_MiB = 1 << 20


def _rss_anon() -> int:
    """This process's resident anonymous memory, bytes."""
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith("RssAnon:"))
    return 1024 * int(line.split()[1])  # "RssAnon:  437320 kB"


def _model(block_size: int = 16) -> LlamaForCausalLM:
    config = tiny_random_config()
    return build_model(config, dict(random_hf_tensors(config)), block_size=block_size)


def test_a_cache_is_resident_only_as_far_as_its_blocks_are_written() -> None:
    model = _model()
    per_block = model.kv_cache_bytes_per_block()
    num_blocks = 256 * _MiB // per_block
    gc.collect()
    before = _rss_anon()
    caches = model.allocate_kv_cache(num_blocks)
    assert _rss_anon() - before < 16 * _MiB  # 256 MiB reserved, nothing written

    # write a quarter of the blocks, every layer, through the views the
    # kernels write by: a quarter of the cache becomes resident
    used = num_blocks // 4
    slots = np.arange(used * model.attention.block_size)
    for k, v in caches:
        for cache in (k, v):
            np.from_dlpack(cache)[:, slots, :] = 1.0
    grown = _rss_anon() - before
    assert 0.9 * used * per_block < grown < used * per_block + 16 * _MiB

    # the rest still reads as zeros, and the memory goes with the cache
    assert not np.from_dlpack(caches[0][0])[:, slots.size :, :].any()
    del caches, k, v, cache
    gc.collect()
    assert _rss_anon() - before < 16 * _MiB


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_lazy_zeros_is_a_zeroed_tensor_paddle_writes_in_place(dtype: str) -> None:
    t = lazy_zeros([2, 8, 4], dtype)
    assert t.dtype == getattr(paddle, dtype)
    assert t.shape == [2, 8, 4] and t.place.is_cpu_place()
    assert not t.astype("float32").numpy().any()
    t[1, 3] = paddle.full([4], 2.5, dtype)
    got = t.astype("float32").numpy()
    assert (got[1, 3] == 2.5).all() and got.sum() == 10.0


@pytest.mark.parametrize("use_kernels", [True, False])
def test_blocks_a_step_does_not_own_are_never_read(use_kernels: bool) -> None:
    # A freed block keeps its last owner's keys and values when the pool
    # hands it out again. Fill every slot with NaN (any stale value poisons
    # a softmax it reaches), then run two sequences on a few blocks: their
    # logits equal a run on a zeroed cache, and are finite.
    model = _model(block_size=4)
    if use_kernels and not model.attention.use_kernels:
        pytest.skip("the compiled kernels are not available")
    model.attention.use_kernels = use_kernels
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 100, 7), rng.integers(0, 100, 3)]
    tables = [[6, 2], [9]]  # block 0 belongs to neither

    def run(stale: float) -> list[np.ndarray]:
        caches = model.allocate_kv_cache(12)
        for k, v in caches:
            for cache in (k, v):
                np.from_dlpack(cache)[...] = stale
        logits = []
        for prompt, table in zip(prompts, tables, strict=True):
            meta = model.attention.build_metadata(
                [SequenceSlice(0, len(prompt), table)]
            )
            out = model.forward(
                paddle.to_tensor(prompt), paddle.arange(len(prompt)), caches, meta
            )
            logits.append(out.numpy()[-1])
        # both decode in one step: rows of 8 and 4 keys, padded to one width
        meta = model.attention.build_metadata(
            [SequenceSlice(len(p), 1, t) for p, t in zip(prompts, tables, strict=True)]
        )
        out = model.forward(
            paddle.to_tensor(np.array([5, 6])),
            paddle.to_tensor(np.array([len(p) for p in prompts])),
            caches,
            meta,
        )
        return [*logits, out.numpy()]

    for got, want in zip(run(np.nan), run(0.0), strict=True):
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, want)


def test_the_pool_hands_out_fresh_blocks_in_order_and_reuses_used_ones_first() -> None:
    # resident memory is the blocks ever handed out: it follows the peak of
    # blocks in use, not the number of allocations
    pool = BlockPool(64, 4)
    first = pool.allocate(5)
    assert first == [0, 1, 2, 3, 4] and pool.num_touched == 5
    pool.free(reversed(first))
    for _ in range(10):
        again = pool.allocate(5)
        assert sorted(again) == first
        pool.free(reversed(again))
    assert pool.num_touched == 5 and pool.num_free == 64
    pool.audit()


@pytest.mark.parametrize(("touch_limit", "touched"), [(None, 3), (2, 2)])
def test_past_the_touch_limit_the_prefix_cache_evicts_instead_of_growing(
    touch_limit: int | None, touched: int
) -> None:
    pool = BlockPool(8, 4, touch_limit=touch_limit)
    cached = pool.allocate(2)
    for i, b in enumerate(cached):
        assert pool.cache_block(b, bytes([i]) * 16)
    pool.free(reversed(cached))
    assert pool.num_cached == 2
    (b,) = pool.allocate(1)
    assert pool.num_touched == touched
    assert pool.num_cached == (2 if touch_limit is None else 1)
    # beyond the limit a fresh block is still taken when nothing else is free
    rest = pool.allocate(pool.num_free)
    assert pool.num_touched == 8 and pool.num_free == 0
    pool.free([b, *rest])
    pool.audit()


@pytest.mark.parametrize(
    ("num_blocks", "memory_blocks", "want"),
    [(None, 100, None), (40, 100, None), (400, 100, 100)],
)
def test_the_touch_limit_is_what_kv_cache_memory_holds_when_fewer_blocks(
    num_blocks: int | None, memory_blocks: int, want: int | None
) -> None:
    config = EngineConfig(model="tiny-random", max_model_len=64, num_blocks=num_blocks)
    loaded = load_engine_model(config)
    per_block = loaded.model.kv_cache_bytes_per_block()
    config = attrs.evolve(config, kv_cache_memory=memory_blocks * per_block)
    _, blocks = size_kv_cache(config, loaded)
    assert blocks == (num_blocks or min(memory_blocks, 64 * 4))
    assert kv_cache_touch_limit(config, loaded, blocks) == want
