"""The prefill attention kernel against the Paddle-op path it replaces.

``PortableAttention`` attends a step's prefill chunks with
``kernels.prefill_attention`` when its kernels run, and with gathers,
matmuls and additive masks when they do not; both must give one answer.
"""

from __future__ import annotations

import numpy as np
import pytest

from structllm.model import kernels
from structllm.model._paddle import paddle
from structllm.model.attention import PortableAttention, SequenceSlice, slots_for

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no numba")

BS = 4  # tokens a block: chunks span several, and end inside one

#: (context_len, query_len): decodes first, then prefill chunks of several
#: lengths, from scratch and after a cached prefix (chunked prefill, a
#: prefix cache hit), one longer than a tile of every group below
STEP = [(6, 1), (0, 1), (0, 37), (13, 20), (40, 3), (0, 2), (5, 60)]


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (16 bits) as Paddle casts it, back in float32."""
    return paddle.cast(paddle.cast(paddle.to_tensor(x), dtype), "float32").numpy()


def _sequences(rng: np.random.Generator, num_blocks: int) -> list[SequenceSlice]:
    """:data:`STEP`'s sequences, their blocks shuffled over the cache."""
    blocks = iter(rng.permutation(num_blocks).tolist())
    return [
        SequenceSlice(c, n, [next(blocks) for _ in range(-(-(c + n) // BS))])
        for c, n in STEP
    ]


def _attend(
    attention: PortableAttention,
    seqs: list[SequenceSlice],
    prefix: tuple[np.ndarray, np.ndarray],  # (kvh, S, d) what the cache holds
    qkv: tuple[np.ndarray, np.ndarray, np.ndarray],  # the step's q, k, v
    window: int | None,
    dtype: str,
) -> np.ndarray:
    """The step's attention output, from caches holding ``prefix``."""
    num_blocks = prefix[0].shape[1] // BS
    caches = [attention.allocate(num_blocks, dtype) for _ in range(2)]
    for cache, values in zip(caches, prefix, strict=True):
        cache.set_value(paddle.to_tensor(values).astype(dtype))
    meta = attention.build_metadata(seqs)
    q, k, v = (paddle.to_tensor(x) for x in qkv)
    out = attention.forward(q, k, v, *caches, meta, window)
    return np.asarray(out.numpy())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [None, 1, 5, 24])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    # a group of 50: a tile of 48 rows ends inside a token's group
    [(8, 2, 16), (9, 3, 64), (4, 4, 24), (7, 1, 16), (50, 1, 8)],
)
def test_prefill_kernel_matches_the_paddle_ops(
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int | None,
    threads: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernels, "_threads", threads)
    monkeypatch.setattr(kernels, "_PARALLEL_MIN_WORK", 0)
    rng = np.random.default_rng(heads * 100 + head_dim)
    num_blocks = 64
    seqs = _sequences(rng, num_blocks)
    shape = (kv_heads, num_blocks * BS, head_dim)
    prefix = tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    tokens = sum(n for _, n in STEP)
    q = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    k, v = (
        rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32)
        for _ in range(2)
    )
    windows = {window}
    ops = PortableAttention(heads, kv_heads, head_dim, BS, windows=windows)
    compiled = PortableAttention(
        heads, kv_heads, head_dim, BS, windows=windows, use_kernels=True
    )
    meta = compiled.build_metadata(seqs)
    assert meta.prefill_items is not None and len(meta.prefills) == 5
    assert meta.prefill_threaded == (threads > 1)
    want = _attend(ops, seqs, prefix, (q, k, v), window, "float32")
    got = _attend(compiled, seqs, prefix, (q, k, v), window, "float32")
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_prefill_kernel_reads_a_16_bit_cache_as_its_values(dtype: str) -> None:
    # the kernels' 16-bit cache against the ops' float32 one holding the
    # same (16-bit-exact) values
    heads, kv_heads, d = 6, 2, 32
    rng = np.random.default_rng(7)
    num_blocks = 64
    seqs = _sequences(rng, num_blocks)
    shape = (kv_heads, num_blocks * BS, d)
    prefix = tuple(
        _rounded(rng.standard_normal(shape).astype(np.float32), dtype) for _ in range(2)
    )
    tokens = sum(n for _, n in STEP)
    q = rng.standard_normal((tokens, heads, d)).astype(np.float32)
    k, v = (
        _rounded(rng.standard_normal((tokens, kv_heads, d)).astype(np.float32), dtype)
        for _ in range(2)
    )
    ops = PortableAttention(heads, kv_heads, d, BS)
    compiled = PortableAttention(heads, kv_heads, d, BS, use_kernels=True)
    want = _attend(ops, seqs, prefix, (q, k, v), None, "float32")
    got = _attend(compiled, seqs, prefix, (q, k, v), None, dtype)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_prefill_items_cover_every_tile_once_costliest_first() -> None:
    # chunks of rows 0-36 (no context) and 37-56 (after 13 cached tokens),
    # a group of 4: 148 and 80 rows, tiles of 48 (12 tokens)
    chunks = np.array([[0, 37, 0], [37, 57, 13]], np.int64)
    items = kernels.prefill_items(chunks, 8, 2)
    tiles = {(0, h, r) for h in range(2) for r in (0, 48, 96, 144)}
    tiles |= {(1, h, r) for h in range(2) for r in (0, 48)}
    assert sorted(map(tuple, items.tolist())) == sorted(tiles)
    # the keys of each tile's last token
    keys = {(0, 0): 12, (0, 48): 24, (0, 96): 36, (0, 144): 37}
    keys |= {(1, 0): 13 + 12, (1, 48): 13 + 20}
    seen = [keys[c, r] for c, _, r in items.tolist()]
    assert seen == sorted(seen, reverse=True)


def test_prefill_attention_refuses_rows_outside_its_queries() -> None:
    q = np.zeros((5, 2, 16), np.float32)
    cache = np.zeros((1, 8, 16), np.float32)
    tables = np.zeros((1, 2), np.int64)
    chunks = np.array([[0, 6, 0]], np.int64)  # 6 rows of 5
    items = kernels.prefill_items(chunks, 2, 1)
    with pytest.raises(IndexError, match="outside the 5 rows"):
        kernels.prefill_attention(
            q, cache, cache, chunks, tables, items, None, 0.25, 4, np.empty_like(q)
        )
    with pytest.raises(ValueError, match="out is"):
        kernels.prefill_attention(
            q, cache, cache, chunks[:, :], tables, items, None, 0.25, 4, q[:4]
        )


def test_slots_for_and_the_kernels_tables_agree_on_a_chunk_after_a_prefix() -> None:
    # the metadata's padded table reaches exactly the chunk's slots
    attention = PortableAttention(4, 2, 16, BS, use_kernels=True)
    seqs = [SequenceSlice(9, 6, [5, 2, 7, 11])]
    meta = attention.build_metadata(seqs)
    assert meta.prefill_tables is not None and meta.prefill_chunks is not None
    table = meta.prefill_tables[0]
    positions = np.arange(15)
    np.testing.assert_array_equal(
        table[positions // BS] * BS + positions % BS,
        slots_for([5, 2, 7, 11], 0, 15, BS),
    )
    np.testing.assert_array_equal(meta.prefill_chunks, [[0, 6, 9]])
    assert meta.max_slot == 12 * BS - 1
