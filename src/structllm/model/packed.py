"""Float32 projections for the CPU kernels: :class:`PackedLinear` keeps a
weight as 32-column panels (``model/panel_kernels.py``) and multiplies
from them.

A served float32 model on the CPU (the eager backend) has its
:class:`~structllm.model.linear.DenseLinear` projections packed at load
(:func:`pack_linears`): the Paddle ``(in, out)`` tensor is replaced, never
kept beside the panels. At the few rows of a decode step MKL's sgemm reads
a weight at a third of the memory's speed and the panels stream at
1.3-7x its speed (Intel and AMD: docs/benchmarks.md "Packed float32
panels"); in prefill they are 0.9x MKL's on Intel and 3-4x on AMD.

A tied head (``DenseLinear(embed, transposed=True)``, which reads the
embedding table) is packed too, and the embedding becomes a
:class:`PackedEmbedding` that looks rows up in the head's panels: the table
is held once, as the panels.

Kept dense: weights of another dtype, models on a GPU, and the other
backends' models (the oneDNN predictors take dense weights as program
inputs; training needs Paddle tensors), so
:func:`~structllm.model.loader.build_model` itself never packs: the serving
loaders do.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import attrs
import numpy as np

from structllm.model import kernels, panel_kernels
from structllm.model._paddle import host_tensor, paddle
from structllm.model.linear import Backend, DenseLinear, HostLinear, Linear
from structllm.model.llama import LAYER_PROJECTIONS, LlamaForCausalLM
from structllm.model.protocol import CausalLM

__all__ = ["PackedEmbedding", "PackedLinear", "pack_linears"]


@attrs.define(eq=False)
class PackedLinear(HostLinear):
    """A float32 weight of HF shape ``(out, in)`` kept as 32-column panels."""

    kind: ClassVar[str] = "packed"
    backends: ClassVar[frozenset[Backend]] = frozenset(("eager",))

    #: float32 ``(ceil(out / 32), in * 32)``, :func:`panel_kernels.pack`'s
    panels: np.ndarray
    _out_features: int
    bias: paddle.Tensor | None = None  # (out,)

    def __attrs_post_init__(self) -> None:
        p = self.panels
        if (
            p.dtype != np.float32
            or p.ndim != 2
            or not p.flags.c_contiguous
            or p.shape[1] % panel_kernels.PANEL
            or p.shape[0] != -(-self._out_features // panel_kernels.PANEL)
        ):
            raise ValueError(
                f"panels {p.dtype} {p.shape} do not hold {self._out_features} "
                "outputs as panel_kernels.pack lays them out"
            )

    @classmethod
    def from_dense(cls, dense: DenseLinear) -> PackedLinear:
        """``dense``'s weight packed (a float32 one; its bias kept)."""
        w = dense.weight.numpy()
        hf = w if dense.transposed else w.T  # (out, in)
        return cls(panel_kernels.pack(hf), int(hf.shape[0]), dense.bias)

    @property
    def in_features(self) -> int:
        return int(self.panels.shape[1]) // panel_kernels.PANEL

    @property
    def out_features(self) -> int:
        return self._out_features

    def matmul_into(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """:meth:`HostLinear.matmul_into` (``panel_kernels.matmul`` checks
        the arrays)."""
        fn, args = self.matmul_calls(x, out)[0]
        fn(*args)
        return out

    def matmul_calls(self, x: np.ndarray, out: np.ndarray) -> list[kernels.Call]:
        """:meth:`HostLinear.matmul_calls`: the one kernel call."""
        if out.ndim == 2 and out.shape[1] != self._out_features:
            raise ValueError(
                f"out has {out.shape[1]} columns, not out_features {self._out_features}"
            )
        return [panel_kernels.matmul_call(x, self.panels, out)]


@attrs.define(eq=False)
class PackedEmbedding:
    """A tied model's token embedding ``(V, H)`` read from its packed head's
    panels (row ``v`` is column ``v`` of the head: ``H`` floats 32 apart),
    so the table is held once. SmolLM2's is 113 MB of float32."""

    head: PackedLinear

    @property
    def dtype(self) -> Any:
        """What a lookup returns: float32."""
        return paddle.float32

    @property
    def shape(self) -> list[int]:
        return [self.head.out_features, self.head.in_features]

    def lookup(self, ids: paddle.Tensor) -> paddle.Tensor:  # (T,) -> (T, H)
        """The rows of ``ids``; an id outside the vocabulary raises IndexError."""
        index = ids.numpy().reshape(-1)
        vocab = self.head.out_features
        if index.size and (index.min() < 0 or index.max() >= vocab):
            bad = index[(index < 0) | (index >= vocab)][0]
            raise IndexError(f"token id {bad} is outside the vocabulary of {vocab}")
        panels = self.head.panels
        columns = panels.reshape(panels.shape[0], -1, panel_kernels.PANEL)
        rows = columns[index // panel_kernels.PANEL, :, index % panel_kernels.PANEL]
        return host_tensor(np.ascontiguousarray(rows))  # (T, H)


def _packable(linear: Linear) -> bool:
    return type(linear) is DenseLinear and linear.weight.dtype == paddle.float32


def _sites(model: LlamaForCausalLM) -> Iterator[tuple[object, str]]:
    for layer in model.weights.layers:
        for name in LAYER_PROJECTIONS:  # the layer's Linear fields
            yield layer, name
    yield model.weights, "lm_head"


def pack_linears(model: CausalLM) -> int:
    """Replace ``model``'s float32 dense projections by
    :class:`PackedLinear`, one at a time (each Paddle weight freed as its
    panels are made), where ``model`` runs eagerly on the CPU with the
    compiled kernels; returns how many were packed (0 elsewhere). A tied
    head's embedding then reads its panels (:class:`PackedEmbedding`).
    Compiles the kernels (or loads them from numba's cache)."""
    if (
        not isinstance(model, LlamaForCausalLM)
        or type(model).backend != "eager"
        or not model.attention.use_kernels
        or not kernels.available()
    ):
        return 0
    weights = model.weights
    head = weights.lm_head
    tied = isinstance(head, DenseLinear) and head.weight is weights.embed
    packed = 0
    for owner, name in _sites(model):
        linear = getattr(owner, name)
        if _packable(linear):
            setattr(owner, name, PackedLinear.from_dense(linear))
            packed += 1
    if tied and isinstance(weights.lm_head, PackedLinear):
        # the table once: lookups read the head's panels
        weights.embed = PackedEmbedding(weights.lm_head)
    if packed:
        panel_kernels.warm_up()
    return packed
