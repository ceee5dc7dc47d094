"""LoRA adapters over any :class:`~structllm.model.linear.Linear`, many at once.

:func:`enable_lora` wraps each decoder projection of a built model (the
fused q/k/v, o, the fused gate/up, down; dense or quantized) in a
:class:`LoRALinear` and returns the model's :class:`LoRASlots`: room for
``max_loras`` adapters of rank up to ``max_lora_rank``, allocated once, so
loading an adapter into a slot (:meth:`LoRASlots.load_adapter`) or
clearing one (:meth:`LoRASlots.clear_slot`) copies its matrices and never
rebuilds the model. Adapters come from PEFT's files
(:func:`~structllm.model.lora_peft.read_peft_adapter`).

A step's rows (many sequences' tokens, flattened) may each use a
different slot: before the forward the caller says which
(:meth:`LoRASlots.set_rows`, or ``model.set_lora_rows``: an int per
row, -1 for none; None when no row uses one), and every wrapper reads that
one shared :class:`LoRABatch`. A wrapper computes ``y = base(x)`` (into
``out=`` when given: the compiled decode path's buffers) and adds, for
each row ``t`` with slot ``s``::

    y[t] += scale_s * (x[t] @ A_s.T) @ B_s.T

in one of two ways (``LoRABatch.method``):

``"kernel"`` (the default where it runs: a float32 model on the CPU, numba)
    one call a projection of ``lora_kernels.add_lora``, the gathered
    low-rank product, whatever the mix of slots;
``"grouped"`` (any dtype, any device)
    per slot in the step: its rows gathered, two small matmuls, added
    back (``index_add_``); all rows on one slot skip the gather.

tools/bench_lora.py measures both: 16 decode rows, 4 on each of three
rank-8 adapters and 4 on none, one thread. A projection's update costs
the kernel 20-110 us (SmolLM2's q/k/v 135 -> 185 us, gate/up 523 ->
598) and grouped 50-190 us (240, 715); a decode step of the 8-layer bench
model +12% by the kernel, +15% grouped (noisy, shared cores). Rows on no
adapter cost nothing (the base's call alone).

Backends: eager only (and so the compiled-kernel decode path, which calls
each Linear with ``out=``). The oneDNN predictors take dense weights as
program inputs and training wants a dense weight's gradient:
``check_backend`` refuses a model with LoRA wrappers by name there, and
:func:`enable_lora` refuses a model built for another backend.

A slot is changed between steps only: the step's compute reads the slots'
matrices unlocked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Literal

import attrs
import numpy as np

from structllm.errors import ModelLoadError
from structllm.model import lora_kernels
from structllm.model._paddle import paddle
from structllm.model.linear import Backend, Linear, check_backend
from structllm.model.lora_peft import (
    LoRAAdapter,
    LoRAProjection,
    read_peft_adapter,
)

if TYPE_CHECKING:
    from structllm.model.llama import LlamaForCausalLM

__all__ = [
    "LoRAAdapter",
    "LoRABatch",
    "LoRALinear",
    "LoRAProjection",
    "LoRASlots",
    "Method",
    "enable_lora",
    "read_peft_adapter",
    "rows_for_sequences",
]

#: how a wrapper adds the rows' updates (see the module docstring)
Method = Literal["kernel", "grouped"]

_NO_TILES = np.zeros((0, 2 + lora_kernels.TILE), np.int64)


@attrs.define(eq=False)
class LoRABatch:
    """Which slot each row of the next forward uses: one object, shared by
    a model and all its :class:`LoRALinear` s."""

    #: (T,) int64, a slot or -1; None: no row uses an adapter
    rows: np.ndarray | None = None
    #: the rows on a slot, in tiles (``lora_kernels.tiles_for``): the kernel's
    tiles: np.ndarray = attrs.field(factory=lambda: _NO_TILES)
    #: per slot the rows use: the slot and its rows' indices (None: all
    #: rows): the grouped compute's
    groups: tuple[tuple[int, paddle.Tensor | None], ...] = ()
    method: Method = "kernel"


@attrs.define(eq=False)
class LoRALinear(Linear):
    """A base :class:`Linear` plus the update of each row's adapter slot.

    Holds every slot's matrices, fused as the base is (``pieces``: the
    outputs of q, k and v, or gate and up, or the one piece): ``a (L, W,
    in)`` and ``b (L, W, out)``, ``W = len(pieces) * max_rank``, zero
    where a slot is empty or an adapter's ranks stop short.
    """

    kind: ClassVar[str] = "lora"
    backends: ClassVar[frozenset[Backend]] = frozenset(("eager",))

    base: Linear
    batch: LoRABatch
    #: output features of each fused piece, in order
    pieces: tuple[int, ...]
    max_loras: int
    max_rank: int
    #: the base's, added by the caller like any Linear's
    bias: paddle.Tensor | None = attrs.field(init=False)
    _a: paddle.Tensor = attrs.field(init=False)  # (L, W, in)
    _b: paddle.Tensor = attrs.field(init=False)  # (L, W, out)
    #: their host views where the kernel runs (float32 on the CPU), else None
    _a_host: np.ndarray | None = attrs.field(init=False)
    _b_host: np.ndarray | None = attrs.field(init=False)
    #: (L, P, 4) int64: each slot's pieces, as LoRAProjection.spans
    _spans: np.ndarray = attrs.field(init=False)
    #: per slot, views of its used rank rows of a and b (None: empty)
    _views: list[tuple[paddle.Tensor, paddle.Tensor] | None] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        base = self.base
        if sum(self.pieces) != base.out_features:
            raise ValueError(
                f"pieces {self.pieces} do not add up to {base.out_features} outputs"
            )
        self.bias = base.bias
        width = len(self.pieces) * self.max_rank
        weight = getattr(base, "weight", None)  # a quantized base computes float32
        dtype = weight.dtype if isinstance(weight, paddle.Tensor) else paddle.float32
        self._a = paddle.zeros([self.max_loras, width, base.in_features], dtype)
        self._b = paddle.zeros([self.max_loras, width, base.out_features], dtype)
        host = (
            dtype == paddle.float32
            and paddle.get_device() == "cpu"
            and lora_kernels.available()
        )
        self._a_host = np.from_dlpack(self._a) if host else None
        self._b_host = np.from_dlpack(self._b) if host else None
        self._spans = np.zeros((self.max_loras, len(self.pieces), 4), np.int64)
        self._spans[:, :, 2:] = self.columns()
        self._views = [None] * self.max_loras

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def columns(self) -> np.ndarray:
        """``(P, 2)``: each piece's output columns ``c0, c1``."""
        ends = np.cumsum(self.pieces)
        return np.stack([ends - np.asarray(self.pieces), ends], axis=1)

    def check(self, update: LoRAProjection) -> str | None:
        """Why ``update`` does not fit this projection, or None."""
        width = len(self.pieces) * self.max_rank
        if update.a.shape[1] != self.in_features:
            return f"A has {update.a.shape[1]} inputs, not {self.in_features}"
        if update.b.shape != (update.width, self.out_features):
            return f"B is {update.b.shape}, not ({update.width}, {self.out_features})"
        if update.width > width:
            return f"{update.width} rank rows, over {width}"
        if update.spans.shape != (len(self.pieces), 4) or not np.array_equal(
            update.spans[:, 2:], self.columns()
        ):
            return f"pieces {update.spans[:, 2:].tolist()}, not {self.columns()}"
        return None

    def set_slot(self, slot: int, update: LoRAProjection | None) -> None:
        """Slot ``slot``'s matrices from ``update`` (None: zero, the base's
        output). The caller checked it (:meth:`check`)."""
        w = 0 if update is None else update.width
        if self._a_host is not None and self._b_host is not None:
            self._a_host[slot] = 0.0
            self._b_host[slot] = 0.0
            if update is not None:
                self._a_host[slot, :w] = update.a
                self._b_host[slot, :w] = update.b
        else:
            a = np.zeros(self._a.shape[1:], np.float32)
            b = np.zeros(self._b.shape[1:], np.float32)
            if update is not None:
                a[:w], b[:w] = update.a, update.b
            self._a[slot] = paddle.to_tensor(a).astype(self._a.dtype)
            self._b[slot] = paddle.to_tensor(b).astype(self._b.dtype)
        self._spans[slot, :, :2] = 0
        if update is not None:
            self._spans[slot, :, :2] = update.spans[:, :2]
        self._views[slot] = None if w == 0 else (self._a[slot, :w], self._b[slot, :w])

    def __call__(
        self, x: paddle.Tensor, out: paddle.Tensor | None = None
    ) -> paddle.Tensor:
        y = self.base(x, out=out)
        batch = self.batch
        rows = batch.rows
        if rows is None:
            return y
        if x.shape[0] != rows.shape[0]:
            raise ValueError(
                f"LoRA rows were set for {rows.shape[0]} rows; the projection got "
                f"{x.shape[0]} (set_lora_rows before each forward)"
            )
        if batch.method == "kernel" and self._a_host is not None:
            assert self._b_host is not None
            # the slots' arrays were made to fit, the base took x, and the
            # tiles' rows are under T (set_rows): nothing to check per call
            lora_kernels.add_lora(
                np.from_dlpack(x),
                batch.tiles,
                self._a_host,
                self._b_host,
                self._spans,
                np.from_dlpack(y),
                checked=True,
            )
            return y
        for slot, index in batch.groups:
            views = self._views[slot]
            if views is None:
                continue
            a, b = views  # (w, in), (w, out)
            xs = x if index is None else paddle.index_select(x, index)
            delta = paddle.matmul(paddle.matmul(xs, a, transpose_y=True), b)
            if index is None:
                y.add_(delta)
            else:
                y.index_add_(index, 0, delta)
        return y


@attrs.define(eq=False)
class LoRASlots:
    """A model's adapter slots: what each holds, and each row's choice."""

    max_loras: int
    max_rank: int
    batch: LoRABatch
    #: module name (``model.layers.0.self_attn.qkv_proj``) -> its wrapper
    linears: Mapping[str, LoRALinear]
    #: what each slot holds
    adapters: list[LoRAAdapter | None] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.adapters = [None] * self.max_loras

    def load_adapter(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put ``adapter`` in ``slot`` (replacing what it held). Refuses
        (:class:`ModelLoadError`, naming the adapter and the projection) an
        adapter that does not fit, before changing anything."""
        self._check_slot(slot)
        self.check_adapter(adapter)
        for name, linear in self.linears.items():
            linear.set_slot(slot, adapter.projections.get(name))
        self.adapters[slot] = adapter

    def check_adapter(self, adapter: LoRAAdapter) -> None:
        """Refuse (:class:`ModelLoadError`, naming the adapter and the
        projection) an adapter that would not fit a slot; the engine asks
        when it reads one, so that loading it into a slot later cannot fail."""
        if adapter.rank > self.max_rank:
            raise ModelLoadError(
                f"{adapter.source}: r={adapter.rank} is over max_lora_rank="
                f"{self.max_rank}"
            )
        for name, update in adapter.projections.items():
            linear = self.linears.get(name)
            why = "the model has no such projection" if linear is None else None
            why = why or (linear.check(update) if linear is not None else None)
            if why is not None:
                raise ModelLoadError(
                    f"{adapter.source}: the update of {name} does not fit the "
                    f"model: {why}"
                )

    def clear_slot(self, slot: int) -> None:
        """Empty ``slot``: its matrices zeroed (rows still naming it would
        compute the base model's output; :meth:`set_rows` refuses them)."""
        self._check_slot(slot)
        for linear in self.linears.values():
            linear.set_slot(slot, None)
        self.adapters[slot] = None

    def set_rows(self, rows: Sequence[int] | np.ndarray | None) -> None:
        """Each row's slot for the forwards from now on (``(T,)``, -1: no
        adapter; None: no row uses one, any T). Refuses a row naming a slot
        out of range or empty."""
        batch = self.batch
        if rows is None:
            batch.rows, batch.tiles, batch.groups = None, _NO_TILES, ()
            return
        r = np.ascontiguousarray(rows, dtype=np.int64)
        if r.ndim != 1:
            raise ValueError(f"rows must be (T,), not {r.shape}")
        used = np.unique(r[r >= 0])
        if r.size and (r.min() < -1 or r.max() >= self.max_loras):
            raise ValueError(f"rows name slots outside -1..{self.max_loras - 1}")
        empty = [int(s) for s in used if self.adapters[s] is None]
        if empty:
            raise ValueError(f"rows name empty slots {empty}")
        if used.size == 0:
            batch.rows, batch.tiles, batch.groups = None, _NO_TILES, ()
            return
        groups: list[tuple[int, paddle.Tensor | None]] = []
        for s in used:
            index = np.flatnonzero(r == s)
            whole = index.size == r.size
            groups.append((int(s), None if whole else paddle.to_tensor(index)))
        batch.rows, batch.tiles = r, lora_kernels.tiles_for(r)
        batch.groups = tuple(groups)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot must be in 0..{self.max_loras - 1}, not {slot}")


def rows_for_sequences(slots: Sequence[int], query_lens: Sequence[int]) -> np.ndarray:
    """Each row's slot from each sequence's, for a step whose sequences
    (in ``build_metadata``'s order) contribute ``query_lens`` rows each."""
    return np.repeat(
        np.asarray(slots, dtype=np.int64), np.asarray(query_lens, dtype=np.int64)
    )


def _pieces(model: LlamaForCausalLM) -> dict[str, tuple[int, ...]]:
    """Each layer field's fused pieces' outputs."""
    c = model.config
    return {
        "qkv": (c.q_size, c.kv_size, c.kv_size),
        "o": (c.hidden_size,),
        "gate_up": (c.intermediate_size, c.intermediate_size),
        "down": (c.hidden_size,),
    }


def enable_lora(
    model: LlamaForCausalLM, *, max_loras: int, max_lora_rank: int
) -> LoRASlots:
    """Wrap ``model``'s decoder projections in :class:`LoRALinear` s with
    room for ``max_loras`` adapters of rank up to ``max_lora_rank``; set
    and return ``model.lora``. Refuses a model whose backend does not run
    them (:class:`ModelLoadError`, by name), and a second call."""
    from structllm.model.llama import LAYER_PROJECTIONS

    if max_loras < 1 or max_lora_rank < 1:
        raise ValueError(
            f"max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) must be >= 1"
        )
    if model.lora is not None:
        raise ValueError("LoRA is already enabled on this model")
    batch = LoRABatch(method="kernel")
    pieces = _pieces(model)
    wrapped: dict[str, LoRALinear] = {}
    for n, layer in enumerate(model.weights.layers):
        for field, module in LAYER_PROJECTIONS.items():
            wrapped[f"model.layers.{n}.{module}"] = LoRALinear(
                getattr(layer, field),
                batch,
                pieces[field],
                max_loras,
                max_lora_rank,
            )
    check_backend(wrapped.items(), model.backend)
    for n, layer in enumerate(model.weights.layers):
        for field, module in LAYER_PROJECTIONS.items():
            setattr(layer, field, wrapped[f"model.layers.{n}.{module}"])
    slots = LoRASlots(max_loras, max_lora_rank, batch, wrapped)
    model.lora = slots
    return slots
