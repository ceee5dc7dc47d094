"""The one way a projection is computed: a :class:`Linear`.

Every projection of the decoder (the fused q/k/v, o, the fused gate/up, down
and the LM head) is a ``Linear``: a weight in some format, an optional bias,
and ``linear(x, out=None)``, ``x @ W`` for ``x`` of ``(T, in)``. The call
never adds the bias: each path adds it where its arithmetic puts it (the
attention kernels add the q/k/v bias while they apply RoPE; a
tensor-parallel rank adds the o and down biases after the all-reduce), so
``linear.bias`` is read by the caller.

A variant names its ``kind`` (``"dense"``; quantized block formats next) and
declares the backends it runs on besides the eager one, which every variant
runs (with ``out=``, into a caller's buffer): the oneDNN predictors take
dense weights as program inputs, training needs gradients of a dense
weight. :func:`check_backend` refuses the others by name when the model is
built, never mid-step; a new variant only declares its ``backends``.

Loading: a checkpoint stores a projection as one or more Hugging Face
tensors in ``(out, in)`` layout (``q_proj``, ``k_proj``, ``v_proj`` for the
fused q/k/v). A :class:`LinearLoader` knows those pieces and which part of
each a tensor-parallel rank keeps (nano-vllm's ``weight_loader``, as
slices: a rank reads its part from safetensors with ``get_slice`` and never
holds the rest), and builds the rank's :class:`DenseLinear` from them.
Column-parallel loaders keep output rows of each piece (q/k/v by head,
gate/up by intermediate column) and their biases; row-parallel ones keep
input columns (o, down) and the whole bias, added once after the sum.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any, ClassVar, Literal

import attrs
import numpy as np

from structllm.errors import ModelLoadError
from structllm.model._paddle import paddle

__all__ = [
    "Backend",
    "ColumnParallelLoader",
    "DenseLinear",
    "HostLinear",
    "Index",
    "Linear",
    "LinearLoader",
    "RowParallelLoader",
    "check_backend",
    "unsupported",
]

#: where a model runs: eager Paddle (every Linear), the oneDNN predictors
#: (``model/compiled.py``), training under autograd (``model/training.py``)
Backend = Literal["eager", "inference", "training"]

#: a rank's part of an HF tensor, in its ``(out, in)`` layout
Index = tuple[slice, ...]


class Linear(abc.ABC):
    """A projection ``(T, in_features) -> (T, out_features)``."""

    #: the weight format, named in refusals
    kind: ClassVar[str]
    #: the backends this variant runs on ("eager" always)
    backends: ClassVar[frozenset[Backend]]
    #: ``(out_features,)``; added by the caller, never by ``__call__``
    bias: paddle.Tensor | None

    @property
    @abc.abstractmethod
    def in_features(self) -> int: ...

    @property
    @abc.abstractmethod
    def out_features(self) -> int: ...

    @abc.abstractmethod
    def __call__(
        self,
        x: paddle.Tensor,  # (T, in_features)
        out: paddle.Tensor | None = None,  # (T, out_features), written if given
    ) -> paddle.Tensor:  # (T, out_features): x @ W, without the bias
        ...


class HostLinear(Linear):
    """A Linear whose weight lives in host memory and is multiplied by
    structllm's own CPU kernels (``QuantizedLinear``, ``PackedLinear``):
    :meth:`matmul_into` takes numpy arrays, and a call on tensors passes
    their host views (DLPack, no copy)."""

    @abc.abstractmethod
    def matmul_into(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``x @ W`` of host arrays: ``x (T, in)`` into ``out (T, out)``,
        both float32 and C-contiguous. Returns ``out``.

        No tensor and no DLPack: a decode step's buffers pass their numpy
        views (``llama._decode_layers``), where a call through tensors
        cost 10-13 us of views and checks, a tenth of the step at batch 1.
        """

    def matmul_calls(
        self, x: np.ndarray, out: np.ndarray
    ) -> list[tuple[Callable[..., Any], tuple[Any, ...]]]:
        """:meth:`matmul_into` of these arrays as kernel calls checked and
        bound once (``kernels.Call``), for a decode plan to run each step
        on what the arrays hold then. This one calls :meth:`matmul_into`."""
        return [(self.matmul_into, (x, out))]

    def __call__(
        self, x: paddle.Tensor, out: paddle.Tensor | None = None
    ) -> paddle.Tensor:
        xh = np.from_dlpack(x)  # (T, in)
        if not xh.flags.c_contiguous:
            xh = np.ascontiguousarray(xh)
        if out is None:
            out = paddle.empty([xh.shape[0], self.out_features], dtype="float32")
        self.matmul_into(xh, np.from_dlpack(out))
        return out


@attrs.define(eq=False)
class DenseLinear(Linear):
    """A weight in the compute dtype: one ``paddle.matmul`` a call."""

    kind: ClassVar[str] = "dense"
    backends: ClassVar[frozenset[Backend]] = frozenset(
        ("eager", "inference", "training")
    )

    #: ``(in, out)``; ``(out, in)`` when ``transposed`` (a tied head reads
    #: the ``(V, H)`` embedding as it is)
    weight: paddle.Tensor
    bias: paddle.Tensor | None = None  # (out,)
    transposed: bool = False

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1 if self.transposed else 0])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0 if self.transposed else 1])

    def __call__(
        self, x: paddle.Tensor, out: paddle.Tensor | None = None
    ) -> paddle.Tensor:
        return paddle.matmul(x, self.weight, transpose_y=self.transposed, out=out)

    def in_out_weight(self) -> paddle.Tensor:
        """The weight ``(in, out)``, contiguous (a transposed one is copied)."""
        w = self.weight.transpose([1, 0]) if self.transposed else self.weight
        return w.contiguous()


def unsupported(
    linears: Iterable[tuple[str, Linear]], backend: Backend
) -> tuple[str, Linear] | None:
    """The first named Linear that does not run on ``backend``, if any."""
    return next(((n, lin) for n, lin in linears if backend not in lin.backends), None)


def check_backend(linears: Iterable[tuple[str, Linear]], backend: Backend) -> None:
    """Refuse (:class:`ModelLoadError`) a model with a Linear that does not
    run on ``backend``, naming it, its kind and the backend."""
    found = unsupported(linears, backend)
    if found is not None:
        name, linear = found
        runs = ", ".join(sorted(linear.backends))
        raise ModelLoadError(
            f"the {backend} backend does not run {linear.kind} Linears "
            f"({name} is one; they run on: {runs})"
        )


def _cast(x: paddle.Tensor, dtype: str) -> paddle.Tensor:
    return x if x.dtype == getattr(paddle, dtype) else x.astype(dtype)


def _whole(ndim: int) -> Index:
    return tuple(slice(None) for _ in range(ndim))


def _span(r: range) -> slice:
    return slice(r.start, r.stop)


@attrs.frozen
class LinearLoader:
    """A projection from its HF tensors, kept whole (replicated on every
    rank: the LM head). Subclasses say which part a rank keeps."""

    #: HF module names, fused in this order along the output
    #: (``model.layers.0.self_attn.q_proj``, ``...k_proj``, ``...v_proj``)
    pieces: tuple[str, ...]
    #: whether the checkpoint holds a ``.bias`` for every piece
    has_bias: bool = attrs.field(default=False, kw_only=True)

    def index(self, piece: int, param: Literal["weight", "bias"]) -> Index:
        """The rank's part of ``pieces[piece]``'s ``param``."""
        return _whole(2 if param == "weight" else 1)

    def slices(self) -> dict[str, Index]:
        """Every HF tensor the projection is built from -> the rank's part."""
        out: dict[str, Index] = {}
        for i, p in enumerate(self.pieces):
            out[p + ".weight"] = self.index(i, "weight")
            if self.has_bias:
                out[p + ".bias"] = self.index(i, "bias")
        return out

    def build(
        self, tensors: MutableMapping[str, paddle.Tensor], dtype: str
    ) -> DenseLinear:
        """The rank's Linear from its parts of the pieces (taken out of
        ``tensors``, already cut as :meth:`slices` says) in ``dtype``."""
        missing = [n for n in self.slices() if n not in tensors]
        if missing:
            raise ModelLoadError(f"the weights lack {', '.join(missing)}")
        parts = [tensors.pop(p + ".weight") for p in self.pieces]  # each (out, in)
        w = paddle.concat(parts, axis=0) if len(parts) > 1 else parts[0]
        bias = None
        if self.has_bias:  # (out,)
            bias = paddle.concat([tensors.pop(p + ".bias") for p in self.pieces])
            bias = _cast(bias, dtype)
        # (out, in) -> (in, out)
        return DenseLinear(_cast(w, dtype).transpose([1, 0]).contiguous(), bias)


@attrs.frozen
class ColumnParallelLoader(LinearLoader):
    """A rank keeps ``rows[i]`` of piece ``i``'s outputs (and of its bias):
    the fused q/k/v (its q heads' and its kv heads' rows) and gate/up (its
    intermediate columns)."""

    rows: tuple[range, ...] = attrs.field(kw_only=True)

    def __attrs_post_init__(self) -> None:
        if len(self.rows) != len(self.pieces):
            raise ValueError(f"{len(self.pieces)} pieces, {len(self.rows)} row ranges")

    def index(self, piece: int, param: Literal["weight", "bias"]) -> Index:
        rows = _span(self.rows[piece])
        return (rows, slice(None)) if param == "weight" else (rows,)


@attrs.frozen
class RowParallelLoader(LinearLoader):
    """A rank keeps ``columns`` of the inputs (o by its q heads, down by its
    intermediate rows) and the whole bias: its output is a partial sum that
    the group's all-reduce completes, and the bias is added once, after."""

    columns: range = attrs.field(kw_only=True)

    def index(self, piece: int, param: Literal["weight", "bias"]) -> Index:
        if param == "bias":
            return (slice(None),)
        return (slice(None), _span(self.columns))
