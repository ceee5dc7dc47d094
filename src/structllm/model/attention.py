"""Attention over a paged KV cache, portable (Paddle ops plus numpy on CPU).

The KV cache of one layer is a K and a V tensor of shape
``(num_kv_heads, num_blocks * block_size, head_dim)``: head-major, so that
gathering a batch's slots yields ``(kv_heads, tokens, head_dim)`` ready for a
batched matmul, with no transpose of the big tensor. A token's *slot* is
``block_id * block_size + offset``; a sequence's *block table* lists its
blocks in order, so position ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size``.

A step's flattened batch holds several sequences, each contributing
``query_len`` new tokens after ``context_len`` tokens already in the cache.
Sequences with one new token (decodes, and one-token prefill chunks) must
come first: they are attended as one padded batch. Each longer chunk
(prefill) is attended on its own, against its cached prefix plus itself.

Paddle has no paged or varlen attention kernel for CPU, hence this backend.
On CPU, the cache's slot writes and gathers go through zero-copy numpy views
(DLPack): ``np.take`` was 10-15x faster than ``paddle.gather`` or tensor
indexing for these shapes (docs/benchmarks.md). Elsewhere Paddle ops do it.
Known trap avoided: ``scaled_dot_product_attention(is_causal=True)`` aligns
the causal mask top-left, which is wrong whenever a query sits after cached
keys; the masks here are built explicitly, bottom-right aligned.

A GPU backend can replace :class:`PortableAttention` by providing the same
``build_metadata`` / ``forward`` pair.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import math
import mmap
import weakref
from collections.abc import Collection, Mapping, Sequence

import attrs
import numpy as np

from structllm.model import kernels
from structllm.model._paddle import host_tensor, paddle

__all__ = [
    "AttentionMetadata",
    "PortableAttention",
    "RopeTables",
    "SequenceSlice",
    "lazy_zeros",
    "slots_for",
]

_NEG_INF = -1e30


@attrs.frozen
class SequenceSlice:
    """One sequence's share of a step: ``query_len`` tokens after ``context_len``."""

    context_len: int
    query_len: int
    block_table: Sequence[int]


def slots_for(
    block_table: Sequence[int], start: int, stop: int, block_size: int
) -> np.ndarray:
    """Slots of positions ``start..stop-1`` under ``block_table``."""
    pos = np.arange(start, stop, dtype=np.int64)
    table = np.asarray(block_table, dtype=np.int64)
    return table[pos // block_size] * block_size + pos % block_size


@attrs.frozen
class _Prefill:
    start: int  # first row of this sequence in the flattened batch
    stop: int
    context: int  # tokens cached before the chunk: row start is at this position
    #: (L,) int64, L = context + query_len; empty with the kernels (they
    #: read through the block table)
    kv_slots: np.ndarray
    #: window -> (q * group, L) additive; empty with the kernels (they mask
    #: as they go)
    masks: Mapping[int | None, paddle.Tensor]


@attrs.frozen
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers."""

    num_tokens: int
    slot_mapping: np.ndarray  # (T,) int64: where each new token's K/V goes
    num_decodes: int  # rows 0..num_decodes-1 are one-token sequences
    decode_slots: np.ndarray | None  # (B * K,) int64, each row padded with its last
    decode_width: int  # K: the longest decode context
    #: window (None: full attention) -> (B, group, K) additive mask
    decode_masks: Mapping[int | None, paddle.Tensor]
    prefills: tuple[_Prefill, ...]
    #: for the compiled kernels instead of slots and masks: (B, max_blocks)
    #: block tables (padded with block 0) and (B,) keys each decode row sees
    decode_tables: np.ndarray | None = None
    decode_lens: np.ndarray | None = None
    use_kernels: bool = False  # write and attend with them
    #: the highest slot any kernel of this step touches: checked against the
    #: cache once a layer (an int compare) rather than by a scan of the
    #: slots a kernel call
    max_slot: int = -1
    #: the decode kernel spreads this step's rows over threads
    decode_threaded: bool = False
    #: for the prefill kernel (``kernels.prefill_attention``): each chunk's
    #: first row, end row and context ``(P, 3)``, its block table ``(P,
    #: max_blocks)`` (padded with block 0), the tiles ``(W, 3)``
    #: (``kernels.prefill_items``), and whether they spread over threads
    prefill_chunks: np.ndarray | None = None
    prefill_tables: np.ndarray | None = None
    prefill_items: np.ndarray | None = None
    prefill_threaded: bool = False


class PortableAttention:
    """Paged attention from gathers and batched matmuls."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        *,
        windows: Collection[int | None] = (None,),
        use_kernels: bool = False,
    ) -> None:
        #: attend (decode rows and prefill chunks) and write the cache with
        #: the compiled CPU kernels (``kernels.py``); needs a float32 model on the host and
        #: numba (the cache may be float32, bfloat16 or float16). May be switched
        #: between steps, not within one.
        self.use_kernels = use_kernels and kernels.available()
        #: the windows layers use: a query at position p sees keys j with
        #: p - j < window; None: all earlier keys. One mask per window a step.
        self.windows = tuple(sorted(set(windows), key=lambda w: (w is not None, w)))
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.block_size = block_size
        self.scale = head_dim**-0.5
        #: host gathers land in these (K, V), reused by every layer and step
        self._gathered = (_Scratch(), _Scratch())
        #: the kernels' rotated queries, reused likewise
        self._rotated_q = _Scratch()
        #: a decode step's projection and attention outputs (and the
        #: model's own, see llama.py), reused by every layer and step
        self.buffers = StepBuffers()
        self._views = _HostViews()  # the caches'
        self._weight_views = _HostViews()  # host_view's

    def build_metadata(self, seqs: Sequence[SequenceSlice]) -> AttentionMetadata:
        """Slots, gathers and masks for ``seqs`` (one-token sequences first)."""
        bs = self.block_size
        slot_parts: list[np.ndarray] = []
        num_decodes = 0
        for s in seqs:
            if s.query_len == 1:
                if num_decodes != len(slot_parts):
                    raise ValueError("one-token sequences must precede longer ones")
                num_decodes += 1
            slot_parts.append(
                slots_for(s.block_table, s.context_len, s.context_len + s.query_len, bs)
            )
        slot_mapping = (
            np.concatenate(slot_parts) if slot_parts else np.zeros(0, np.int64)
        )

        decode_slots = decode_tables = decode_lens = None
        decode_masks: dict[int | None, paddle.Tensor] = {}
        width = 0
        if num_decodes and self.use_kernels:
            decode_lens, decode_tables = _padded_tables(seqs[:num_decodes], bs)
            width = int(decode_lens.max())
        elif num_decodes:
            lens = np.array([s.context_len + 1 for s in seqs[:num_decodes]])
            width = int(lens.max())
            slots = np.empty((num_decodes, width), dtype=np.int64)
            for i, s in enumerate(seqs[:num_decodes]):
                slots[i, : lens[i]] = slots_for(s.block_table, 0, lens[i], bs)
                # padded with the row's own newest slot, not another block's:
                # masked out either way, but a stale NaN or inf times a zero
                # weight would still poison the row
                slots[i, lens[i] :] = slots[i, lens[i] - 1]
            keys = np.arange(width)[None, :]
            valid = keys < lens[:, None]  # (B, K)
            for window in self.windows:
                seen = (
                    valid
                    if window is None
                    else valid & (keys >= lens[:, None] - window)
                )
                decode_masks[window] = self._mask(seen)
            decode_slots = slots.reshape(-1)

        prefills = []
        row = num_decodes
        for s in seqs[num_decodes:]:
            total = s.context_len + s.query_len
            kv = np.zeros(0, np.int64)
            masks = {}
            if not self.use_kernels:
                kv = slots_for(s.block_table, 0, total, bs)
                # query i (at position context_len + i) sees keys 0..context_len+i
                q_pos = s.context_len + np.arange(s.query_len)[:, None]
                keys = np.arange(total)[None, :]
                visible = keys <= q_pos  # (q, L)
                for window in self.windows:
                    near = q_pos - keys < window if window is not None else True
                    seen = visible & near
                    masks[window] = self._mask(seen).reshape([-1, total])  # (q g, L)
            prefills.append(
                _Prefill(
                    start=row,
                    stop=row + s.query_len,
                    context=s.context_len,
                    kv_slots=kv,
                    masks=masks,
                )
            )
            row += s.query_len
        chunks = tables = items = None
        prefill_work = 0
        if prefills and self.use_kernels:
            chunks = np.array(
                [(p.start, p.stop, p.context) for p in prefills], np.int64
            )
            # the new tokens' slots above cover each chunk's last position
            lens, tables = _padded_tables(seqs[num_decodes:], bs)
            items = kernels.prefill_items(chunks, self.num_heads, self.num_kv_heads)
            # as a decode's: kv heads x queries x keys (the most a query sees)
            n = chunks[:, 1] - chunks[:, 0]
            prefill_work = self.num_kv_heads * int((n * lens).sum())
        max_slot = None
        if self.use_kernels and seqs:
            if slot_mapping.min() < 0:
                raise IndexError("slot out of range: negative")
            max_slot = int(slot_mapping.max())
            for read in (decode_tables, tables):
                if read is None:
                    continue
                if read.min() < 0:
                    raise IndexError("block out of range: negative")
                # the kernels read whole blocks' worth of slots at most
                max_slot = max(max_slot, (int(read.max()) + 1) * bs - 1)
        return AttentionMetadata(
            num_tokens=row,
            slot_mapping=slot_mapping,
            num_decodes=num_decodes,
            decode_slots=decode_slots,
            decode_width=width,
            decode_masks=decode_masks,
            prefills=tuple(prefills),
            decode_tables=decode_tables,
            decode_lens=decode_lens,
            use_kernels=self.use_kernels,
            max_slot=-1 if max_slot is None else max_slot,
            decode_threaded=kernels.worth_threading(
                num_decodes * self.num_kv_heads * width
            ),
            prefill_chunks=chunks,
            prefill_tables=tables,
            prefill_items=items,
            prefill_threaded=kernels.worth_threading(prefill_work),
        )

    def _mask(self, seen: np.ndarray) -> paddle.Tensor:
        """``(rows, keys)`` booleans -> an additive ``(rows, group, keys)`` mask.

        Decode scores are ``(kv_heads, rows, group, keys)``, prefill scores
        ``(kv_heads, rows * group, keys)`` (the caller reshapes). A mask that
        differs from them only in its leading dimension adds 6-19x faster in
        Paddle on CPU than a ``(1, rows, 1, keys)`` one (docs/benchmarks.md),
        so the group axis is spelled out here, once a step, rather than
        broadcast per layer.
        """
        mask = np.where(seen, 0.0, _NEG_INF).astype(np.float32)[:, None, :]
        if self.group > 1:
            mask = np.repeat(mask, self.group, axis=1)
        return host_tensor(mask)

    def allocate(self, num_blocks: int, dtype: str | paddle.dtype) -> paddle.Tensor:
        """One layer's K (or V) cache: ``(kv_heads, num_blocks * block_size, d)``.

        On the CPU its pages are committed as slots are first written, not
        at start (:func:`lazy_zeros`): resident memory follows the blocks
        the pool has handed out, not the cache's size.
        """
        shape = [self.num_kv_heads, num_blocks * self.block_size, self.head_dim]
        if paddle.get_device() != "cpu":
            return paddle.zeros(shape, dtype=dtype)
        return lazy_zeros(shape, dtype)

    def forward(
        self,
        q: paddle.Tensor,  # (T, num_heads, head_dim)
        k: paddle.Tensor,  # (T, num_kv_heads, head_dim)
        v: paddle.Tensor,  # (T, num_kv_heads, head_dim)
        k_cache: paddle.Tensor,  # (num_kv_heads, num_slots, head_dim)
        v_cache: paddle.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
    ) -> paddle.Tensor:  # (T, num_heads * head_dim)
        """Attend ``q`` over the cache (after writing ``k``/``v``) under ``window``."""
        if meta.use_kernels:
            k_host, v_host = self._host_cache(k_cache, v_cache, meta)
            # written before attending: each row's own key is its last
            kernels.write_kv(
                _host(k), _host(v), k_host, v_host, meta.slot_mapping, checked=True
            )
            return self._attend_kernels(_host(q), (k_host, v_host), meta, window)
        cache = _SlotIO(k_cache, v_cache, self._gathered, self._views)
        outs = []
        cache.write(meta.slot_mapping, k, v)
        if meta.num_decodes:
            outs.append(self._decode_ops(q, cache, meta, window))
        outs.extend(self._prefill(q, p, cache, window) for p in meta.prefills)
        return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)

    def host_view(self, tensor: paddle.Tensor) -> np.ndarray:
        """A long-lived host tensor's numpy view (a weight: norms, biases),
        made once and dropped with the tensor (kept apart from the caches'
        views, which a test counts)."""
        return self._weight_views.get(tensor)

    def qkv_buffer(
        self, meta: AttentionMetadata, width: int
    ) -> tuple[paddle.Tensor, np.ndarray] | None:
        """A tensor for a decode step's fused q/k/v projection (a matmul's
        ``out=``) and its host view, reused by every layer and every step of
        that batch size; None for a step with prefill rows (their sizes vary
        too much to keep a buffer each)."""
        if meta.num_decodes != meta.num_tokens:
            return None
        return self.buffers.get("qkv", (meta.num_tokens, width))

    def forward_qkv(
        self,
        qkv: np.ndarray,  # (T, (nh + 2 kvh) d): [q | k | v] before bias and RoPE
        k_cache: paddle.Tensor,  # (num_kv_heads, num_slots, head_dim)
        v_cache: paddle.Tensor,
        meta: AttentionMetadata,
        positions: np.ndarray,  # (T,) int64, each inside the RoPE tables
        rope: RopeTables,
        window: int | None = None,
        q_norm: paddle.Tensor | None = None,  # (d,) Qwen3
        k_norm: paddle.Tensor | None = None,
        eps: float = 0.0,
        bias: paddle.Tensor | None = None,  # ((nh + 2 kvh) d,) Qwen2
    ) -> paddle.Tensor:  # (T, num_heads * head_dim)
        """The whole attention from the fused q/k/v projection (on the host),
        by the kernels.

        One pass adds the projection's bias and does Qwen3's q/k norm, RoPE
        and the cache writes (``kernels.rope_and_write``); decode rows are
        attended in place, prefill rows as in :meth:`forward`. Needs
        ``meta.use_kernels``, and ``positions`` checked against ``rope`` by
        the caller (once a step: the kernel reads the tables unchecked).

        A step of decode rows alone returns a tensor whose memory the next
        call reuses (a Paddle op per layer saved; the o projection reads it
        at once): use it before attending the next layer.
        """
        assert meta.use_kernels
        k_host, v_host = self._host_cache(k_cache, v_cache, meta)
        q_host = self._rope_and_write(
            qkv, k_host, v_host, meta, positions, rope, q_norm, k_norm, eps, bias
        )
        return self._attend_kernels(q_host, (k_host, v_host), meta, window)

    def decode_call(
        self,
        qkv: np.ndarray,  # (B, (nh + 2 kvh) d): [q | k | v] before bias and RoPE
        k_cache: paddle.Tensor,  # (num_kv_heads, num_slots, head_dim)
        v_cache: paddle.Tensor,
        step: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        q: np.ndarray,  # (B, nh, d) scratch: the rotated queries
        out: np.ndarray,  # (B, nh, d)
        rope: RopeTables,
        window: int | None = None,
        q_norm: paddle.Tensor | None = None,
        k_norm: paddle.Tensor | None = None,
        eps: float = 0.0,
        bias: paddle.Tensor | None = None,
        *,
        threaded: bool = False,
    ) -> kernels.Call:
        """The whole attention of a step of decode rows alone from their
        fused q/k/v projection, as :meth:`forward_qkv` computes it, as a
        kernel call into ``out`` bound to these arrays, not run
        (``kernels.rope_write_attend_call``: a decode plan's). ``step``:
        positions, slots, block tables and key counts (``decode_lens``),
        read when the call runs; the caller has checked each run's slots
        against the cache (:meth:`check_slots`) and its positions."""
        positions, slots, tables, lens = step
        return kernels.rope_write_attend_call(
            qkv,
            positions,
            rope.cos,
            rope.sin,
            None if q_norm is None else self.host_view(q_norm),
            None if k_norm is None else self.host_view(k_norm),
            eps,
            self._views.get(k_cache),
            self._views.get(v_cache),
            slots,
            q,
            tables,
            lens,
            window,
            self.scale,
            self.block_size,
            out,
            bias=None if bias is None else self.host_view(bias),
            threaded=threaded,
        )

    def _rope_and_write(
        self,
        qkv: np.ndarray,  # (T, (nh + 2 kvh) d)
        k_host: np.ndarray,  # (kvh, S, d) checked against meta.max_slot
        v_host: np.ndarray,
        meta: AttentionMetadata,
        positions: np.ndarray,  # (T,) checked
        rope: RopeTables,
        q_norm: paddle.Tensor | None,
        k_norm: paddle.Tensor | None,
        eps: float,
        bias: paddle.Tensor | None,
    ) -> np.ndarray:  # (T, nh, d) the rotated queries, reused by the next call
        """``kernels.rope_and_write``'s pass: the cache writes, and the
        rotated queries into the scratch buffer."""
        t = meta.num_tokens
        q_host = self._rotated_q.array((t, self.num_heads, self.head_dim))
        kernels.rope_and_write(
            qkv,
            positions,
            rope.cos,
            rope.sin,
            self.num_heads,
            None if q_norm is None else self.host_view(q_norm),
            None if k_norm is None else self.host_view(k_norm),
            eps,
            k_host,
            v_host,
            meta.slot_mapping,
            q_host,
            bias=None if bias is None else self.host_view(bias),
            checked=True,
        )
        return q_host

    def _attention_shape(self, meta: AttentionMetadata) -> tuple[int, int]:
        return (meta.num_decodes, self.num_heads * self.head_dim)

    def _host_cache(
        self, k_cache: paddle.Tensor, v_cache: paddle.Tensor, meta: AttentionMetadata
    ) -> tuple[np.ndarray, np.ndarray]:
        """The caches' host views, the step's slots checked against them."""
        k_host, v_host = self._views.get(k_cache), self._views.get(v_cache)
        self.check_slots(k_host.shape[1], meta)
        return k_host, v_host

    @staticmethod
    def check_slots(num_slots: int, meta: AttentionMetadata) -> None:
        """That the step's slots are inside a cache of ``num_slots``."""
        if meta.max_slot >= num_slots:
            raise IndexError(
                f"slot out of range for a cache of {num_slots} (slot {meta.max_slot})"
            )

    def _attend_kernels(
        self,
        q: np.ndarray,  # (T, nh, d) rotated
        host_caches: tuple[np.ndarray, np.ndarray],  # this step's keys written
        meta: AttentionMetadata,
        window: int | None,
    ) -> paddle.Tensor:  # (T, nh * d)
        """Every row, the kernels' way, reading the cache in place: decode
        rows in one call, prefill chunks in another."""
        nh, d = self.num_heads, self.head_dim
        b = meta.num_decodes
        if not meta.prefills:  # the output's memory is reused (see forward_qkv)
            tensor, flat = self.buffers.get("attention", self._attention_shape(meta))
        else:
            tensor = paddle.empty([meta.num_tokens, nh * d], "float32")
            flat = np.from_dlpack(tensor)
        if b:
            self._attend_decodes(q, host_caches, meta, window, flat)
        if meta.prefills:
            assert meta.prefill_chunks is not None
            assert meta.prefill_tables is not None and meta.prefill_items is not None
            kernels.prefill_attention(
                q,
                *host_caches,
                meta.prefill_chunks,
                meta.prefill_tables,
                meta.prefill_items,
                window,
                self.scale,
                self.block_size,
                flat.reshape(meta.num_tokens, nh, d),
                threaded=meta.prefill_threaded,
            )
        return tensor

    def _attend_decodes(
        self,
        q: np.ndarray,  # (T, nh, d) rotated, decode rows first
        host_caches: tuple[np.ndarray, np.ndarray],  # this step's keys written
        meta: AttentionMetadata,
        window: int | None,
        out: np.ndarray,  # (T, nh * d): the decode rows' are written
    ) -> None:
        """The decode rows, in one kernel call reading the cache in place."""
        b = meta.num_decodes
        assert meta.decode_tables is not None and meta.decode_lens is not None
        kernels.decode_attention(
            q[:b],
            *host_caches,
            meta.decode_tables,
            meta.decode_lens,
            window,
            self.scale,
            self.block_size,
            out=out[:b].reshape(b, self.num_heads, self.head_dim),
            threaded=meta.decode_threaded,
        )

    def _decode_ops(
        self,
        q: paddle.Tensor,  # (T, nh, d)
        cache: _SlotIO,
        meta: AttentionMetadata,
        window: int | None,
    ) -> paddle.Tensor:  # (B, nh * d)
        """The decode rows as one padded batch: gathers, matmuls, masks."""
        kvh, g, d = self.num_kv_heads, self.group, self.head_dim
        b, width = meta.num_decodes, meta.decode_width
        assert meta.decode_slots is not None
        kd, vd = cache.gather(meta.decode_slots)  # (kvh, B * K, d)
        qd = q[:b].reshape([b, kvh, g, d]).transpose([1, 0, 2, 3])  # (kvh, B, g, d)
        out = self._attend(
            qd,
            kd.reshape([kvh, b, width, d]),
            vd.reshape([kvh, b, width, d]),
            meta.decode_masks[window],
        )  # (kvh, B, g, d)
        return out.transpose([1, 0, 2, 3]).reshape([b, kvh * g * d])

    def _prefill(
        self,
        q: paddle.Tensor,  # (T, nh, d)
        p: _Prefill,
        cache: _SlotIO,
        window: int | None,
    ) -> paddle.Tensor:  # (n, nh * d)
        """One prefill chunk against its cached prefix and itself."""
        kvh, g, d = self.num_kv_heads, self.group, self.head_dim
        n = p.stop - p.start
        kp, vp = cache.gather(p.kv_slots)  # (kvh, L, d)
        qp = q[p.start : p.stop].reshape([n, kvh, g * d]).transpose([1, 0, 2])
        # (kvh, q g, d) @ (kvh, L, d)^T -> (kvh, q g, L): one matmul a kv
        # head (a (kvh, q, g, d) @ (kvh, 1, L, d) broadcast is 6x slower)
        qp = qp.reshape([kvh, n * g, d])
        out = self._attend(qp, kp, vp, p.masks[window])
        out = out.reshape([kvh, n, g * d]).transpose([1, 0, 2])
        return out.reshape([n, kvh * g * d])

    def _attend(
        self,
        q: paddle.Tensor,
        k: paddle.Tensor,
        v: paddle.Tensor,
        mask: paddle.Tensor | None,
    ) -> paddle.Tensor:
        scores = paddle.matmul(q, k, transpose_y=True) * self.scale
        if scores.dtype != paddle.float32:
            scores = scores.astype(paddle.float32)
        if mask is not None:
            scores = scores + mask
        probs = paddle.nn.functional.softmax(scores, axis=-1).astype(v.dtype)
        return paddle.matmul(probs, v)


#: host dtypes a lazily committed cache can hold, as numpy sees their bits
_LAZY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16}


@functools.cache
def _libc() -> ctypes.PyDLL:
    """libc's ``mmap``/``munmap``, called with the GIL held (``PyDLL``)."""
    libc = ctypes.PyDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_long,
    ]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


class _AnonymousPages:
    """``size`` bytes of private anonymous memory (``mmap(2)``), unmapped when
    the last array over them is freed, *without releasing the GIL*.

    Python's ``mmap`` object releases the GIL around ``munmap`` in its
    dealloc. Freed as a Paddle tensor's DLPack base, that dealloc runs
    inside Paddle's deleter, under Paddle's deleter mutex: another thread
    freeing any DLPack tensor then holds the GIL and waits for that mutex
    while this one waits for the GIL, a deadlock (seen with four
    tensor-parallel ranks in threads, each freeing its cache). ``mmap`` and
    ``munmap`` through ``ctypes.PyDLL`` keep the GIL, as a plain numpy
    array's free does.
    """

    def __init__(self, size: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        address = _libc().mmap(None, size, prot, flags, -1, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            raise MemoryError(f"mmap of {size} bytes failed")
        self.address: int = address
        self.size = size
        self.__array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }

    def __del__(self) -> None:
        _libc().munmap(self.address, self.size)


def lazy_zeros(shape: Sequence[int], dtype: str | paddle.dtype) -> paddle.Tensor:
    """A zeroed CPU tensor whose memory is committed page by page, on first write.

    ``paddle.zeros`` writes every byte at once, so a KV cache was resident in
    full from the start whatever it held (360 MiB for SmolLM2-135M's 512
    blocks). Here the memory is a private anonymous mapping, shared with
    Paddle through DLPack: the kernel maps its shared zero page for every
    page until one is written, so reading a never-written slot costs
    nothing and yields zeros. The tensor keeps the mapping alive; it is
    unmapped when the tensor is freed. bfloat16 goes through int16 bits
    (numpy has no bfloat16); another dtype, or a system without POSIX
    ``mmap``, gets ``paddle.zeros``.
    """
    name = str(dtype).removeprefix("paddle.")
    np_dtype = _LAZY_DTYPES.get(name)
    if np_dtype is None or not hasattr(mmap, "MAP_ANONYMOUS"):  # or not POSIX
        return paddle.zeros(list(shape), dtype=dtype)
    size = math.prod(shape) * np.dtype(np_dtype).itemsize
    pages = np.asarray(_AnonymousPages(max(size, 1)))  # keeps them as its base
    array = pages[:size].view(np_dtype).reshape(shape)
    # not host_tensor: its holder would keep the last cache's memory alive
    # after the cache is freed (from_dlpack's small leak is once a cache)
    tensor = paddle.from_dlpack(array)
    return tensor.view(paddle.bfloat16) if name == "bfloat16" else tensor


def _padded_tables(
    seqs: Sequence[SequenceSlice], block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Keys each sequence's last new token sees, and its block table padded
    with 0.

    The kernels read ``table[p // block_size]`` for every position ``p``
    below the length, unchecked; a table too short for its length has
    already failed :func:`slots_for` for the last new token's slot.
    """
    lens = np.array([s.context_len + s.query_len for s in seqs], dtype=np.int64)
    tables = np.zeros((len(seqs), max(len(s.block_table) for s in seqs)), np.int64)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = s.block_table
    return lens, tables


def _host(t: paddle.Tensor) -> np.ndarray:
    """A C-contiguous host array of ``t`` (a copy only if ``t`` is strided)."""
    return np.from_dlpack(t.contiguous())


@attrs.frozen
class RopeTables:
    """Full-width RoPE tables on the host, ``(max_len, head_dim)`` float32:
    ``cos = [c | c]`` and ``sin = [-s | s]`` (see ``llama._apply_rope``)."""

    cos: np.ndarray
    sin: np.ndarray


def _host_array(tensor: paddle.Tensor) -> np.ndarray:
    """A numpy view of a host tensor; of a 16-bit float one, its bits as the
    kernels take them (``kernels.CACHE_BITS``: numpy has no bfloat16, DLPack
    exports none, and the kernels' numba has no float16)."""
    if tensor.dtype in (paddle.bfloat16, paddle.float16):
        bits: np.ndarray = np.from_dlpack(tensor.view(paddle.int16))
        return bits.view(kernels.CACHE_BITS[str(tensor.dtype).removeprefix("paddle.")])
    array: np.ndarray = np.from_dlpack(tensor)
    return array


class _HostViews:
    """numpy views of long-lived host tensors (the KV caches), made once each.

    ``np.from_dlpack`` costs 10-20 us in the middle of a step (cold caches),
    twice a layer. A view is dropped with its tensor (a weak reference), so
    a freed cache's memory is not kept alive here.
    """

    def __init__(self) -> None:
        #: id(tensor) -> a weak reference to it, and its view
        self._views: dict[int, tuple[weakref.ref[paddle.Tensor], np.ndarray]] = {}

    def get(self, tensor: paddle.Tensor) -> np.ndarray:
        key = id(tensor)
        hit = self._views.get(key)
        if hit is not None and hit[0]() is tensor:
            return hit[1]
        view = _host_array(tensor)
        views = self._views

        def forget(_: object) -> None:
            views.pop(key, None)

        self._views[key] = (weakref.ref(tensor, forget), view)
        return view


class StepBuffers:
    """Host tensors a decode step reuses, each with its numpy view, by name
    and shape: the step's matmuls write into them (``out=``) and the
    kernels read and write their views, so a layer makes no tensor and no
    view (each costs 10-30 us in the middle of a step). Buffers of the last
    ``keep`` batch sizes are kept (a server's batch changes a request at a
    time); older ones are dropped."""

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        #: rows -> (name, shape) -> tensor and view; most recent last
        self._by_rows: collections.OrderedDict[
            int, dict[tuple[str, tuple[int, ...]], tuple[paddle.Tensor, np.ndarray]]
        ] = collections.OrderedDict()

    def get(
        self, name: str, shape: tuple[int, ...]
    ) -> tuple[paddle.Tensor, np.ndarray]:
        """The float32 buffer ``name`` of ``shape`` (rows first): uninitialised
        when new, else as the last step left it."""
        rows = shape[0]
        entries = self._by_rows.get(rows)
        if entries is None:
            entries = self._by_rows[rows] = {}
            while len(self._by_rows) > self._keep:
                self._by_rows.popitem(last=False)
        else:
            self._by_rows.move_to_end(rows)
        hit = entries.get((name, shape))
        if hit is None:
            tensor = paddle.empty(list(shape), "float32")
            hit = entries[(name, shape)] = (tensor, np.from_dlpack(tensor))
        return hit


class _Scratch:
    """A float32 host buffer that grows to the largest use seen."""

    def __init__(self) -> None:
        self._buf = np.empty(0, np.float32)

    def array(self, shape: tuple[int, ...]) -> np.ndarray:
        """An uninitialised ``shape`` view of this buffer (valid until the next)."""
        size = math.prod(shape)
        if self._buf.size < size:
            self._buf = np.empty(size, np.float32)
        return self._buf[:size].reshape(shape)

    def take(self, src: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """``np.take(src, slots, axis=1)`` into this buffer (valid until the next)."""
        if slots.size and not (slots.min() >= 0 and slots.max() < src.shape[1]):
            raise IndexError(f"slot out of range for a cache of {src.shape[1]}")
        out = self.array((src.shape[0], slots.size, *src.shape[2:]))
        # mode="clip" (range checked above): with "raise", out= goes through
        # a temporary copy
        return np.take(src, slots, axis=1, out=out, mode="clip")


class _SlotIO:
    """Writes and gathers cache slots; numpy views on CPU, Paddle ops elsewhere.

    Host gathers go into buffers kept across layers and steps: a fresh array
    per gather (1.6 MB for 16 sequences of 200 tokens) is fresh pages from
    the kernel each time, and those page faults made the gathers the larger
    part of a batch-16 decode step's attention (docs/benchmarks.md).
    """

    def __init__(
        self,
        k_cache: paddle.Tensor,
        v_cache: paddle.Tensor,
        scratch: tuple[_Scratch, _Scratch],
        views: _HostViews,
    ) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self.scratch = scratch
        self.views = views
        # numpy reads a float32 cache; Paddle ops any other (a 16-bit one
        # left by the kernels, kv_cache_dtype), as on an accelerator
        self.host = k_cache.place.is_cpu_place() and k_cache.dtype == paddle.float32

    def write(self, slots: np.ndarray, k: paddle.Tensor, v: paddle.Tensor) -> None:
        if self.host:
            for cache, new in ((self.k_cache, k), (self.v_cache, v)):
                # (T, kvh, d) -> slots of (kvh, S, d), in place through views
                np.from_dlpack(cache)[:, slots, :] = np.from_dlpack(
                    new.contiguous()
                ).transpose(1, 0, 2)
            return
        index = paddle.to_tensor(slots)
        for cache, new in ((self.k_cache, k), (self.v_cache, v)):
            flat = cache.transpose([1, 0, 2])
            updated = paddle.scatter(flat, index, new, overwrite=True)
            paddle.assign(updated.transpose([1, 0, 2]), cache)

    def gather(self, slots: np.ndarray) -> tuple[paddle.Tensor, paddle.Tensor]:
        """K and V at ``slots``: ``(kvh, len(slots), d)``, valid until the next."""
        if self.host:
            k_buf, v_buf = self.scratch
            return (
                host_tensor(k_buf.take(self.views.get(self.k_cache), slots)),
                host_tensor(v_buf.take(self.views.get(self.v_cache), slots)),
            )
        index = paddle.to_tensor(slots)
        return (
            paddle.gather(self.k_cache, index, axis=1),
            paddle.gather(self.v_cache, index, axis=1),
        )
