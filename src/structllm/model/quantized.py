"""Quantized projections: :class:`QuantizedLinear` keeps a weight in llama.cpp's
block layout and multiplies from it (``model/quant_kernels.py``).

A GGUF file's projection weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K, F16, BF16) stay as the file holds them: rows of blocks, a scale (and
a min) and packed integers, never a float32 copy. The fused projections
structllm runs (q/k/v, gate/up) are their pieces' rows one after another:
rows of one type are concatenated into one weight (a row is independent of
the others, so a fused weight's rows are its pieces' rows), and pieces of
different types (a Q4_K_M file keeps some ``attn_v`` in Q6_K) are one
kernel call each into their columns of the output.

Activations are float32 by default (the product with the dequantized
weight, to rounding: greedy tokens are a float32 run's); ``activations =
"q8"`` quantizes them first and multiplies in integers, as llama.cpp
does: to Q8_0/Q8_1 blocks for the 32-value types
(``quant_kernels.Q8_TYPES``), to 256-value Q8_K blocks for Q4_K and Q6_K
(``quant_kernels.Q8K_TYPES``); Q5_K stays on float activations. 1.2-3x
faster a GEMV at one token (slower than float at 16 tokens and in
prefill), llama.cpp's results rather than the float product
(``quant_kernels``'s module doc measures both).

Runs in the eager backend only (the oneDNN predictors take dense weights as
program inputs; training needs a float weight): ``check_backend`` refuses
the others by name when the model is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np

from structllm.errors import EngineConfigError, ModelLoadError
from structllm.model import kernels, quant_kernels
from structllm.model._paddle import host_tensor, paddle
from structllm.model.linear import Backend, HostLinear, Linear

__all__ = [
    "ACTIVATIONS",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedPart",
    "quantized_linears",
    "set_activations",
    "warm_up",
]

#: how a :class:`QuantizedLinear` takes its input (``quant_kernels.matmul``)
ACTIVATIONS = ("float", "q8")


@attrs.frozen
class QuantizedPart:
    """Output rows ``(rows, row_bytes)`` of one GGML type, read-only (the
    kernels are compiled for read-only weights: :func:`~structllm.model.
    quant_kernels.read_only`)."""

    raw: np.ndarray = attrs.field(converter=quant_kernels.read_only)
    """uint8 (rows, row_bytes), C-contiguous"""
    qtype: int

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0])


@attrs.define(eq=False)
class QuantizedLinear(HostLinear):
    """A weight of HF shape ``(out, in)`` kept in GGML block rows."""

    kind: ClassVar[str] = "quantized"
    backends: ClassVar[frozenset[Backend]] = frozenset(("eager",))

    parts: tuple[QuantizedPart, ...]
    _in_features: int
    bias: paddle.Tensor | None = None  # (out,)
    #: "float" or "q8" (:data:`ACTIVATIONS`); see the module doc
    activations: str = attrs.field(
        default="float", kw_only=True, validator=attrs.validators.in_(ACTIVATIONS)
    )
    _out_features: int = attrs.field(init=False)
    _columns: tuple[tuple[int, int], ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        columns, start = [], 0
        for part in self.parts:
            quant_kernels.row_bytes(part.qtype, self._in_features)  # checks type
            if part.raw.dtype != np.uint8 or part.raw.ndim != 2:
                raise ModelLoadError(
                    f"a quantized part must be uint8 rows, not {part.raw.dtype} "
                    f"{part.raw.shape}"
                )
            columns.append((start, start + part.rows))
            start += part.rows
        self._out_features = start
        self._columns = tuple(columns)

    @classmethod
    def fuse(
        cls,
        pieces: Sequence[QuantizedPart],
        in_features: int,
        bias: paddle.Tensor | None = None,
    ) -> QuantizedLinear:
        """One Linear from pieces stacked along the output (q, k, v): runs of
        the same type become one weight (their rows copied together)."""
        merged: list[QuantizedPart] = []
        for piece in pieces:
            if merged and merged[-1].qtype == piece.qtype:
                raw = np.concatenate([merged[-1].raw, piece.raw])
                merged[-1] = QuantizedPart(raw, piece.qtype)
            else:
                merged.append(
                    QuantizedPart(np.ascontiguousarray(piece.raw), piece.qtype)
                )
        return cls(tuple(merged), in_features, bias)

    @property
    def in_features(self) -> int:
        return self._in_features

    @property
    def out_features(self) -> int:
        return self._out_features

    @property
    def nbytes(self) -> int:
        """Bytes of weight a call reads."""
        return sum(int(p.raw.nbytes) for p in self.parts)

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(quant_kernels.GGMLType(p.qtype).name for p in self.parts)

    def matmul_calls(self, x: np.ndarray, out: np.ndarray) -> list[kernels.Call]:
        """:meth:`HostLinear.matmul_calls`: each part's kernel call into its
        columns of ``out`` (contiguous at one row; else the whole
        :meth:`matmul_into`)."""
        calls = []
        for part, (a, b) in zip(self.parts, self._columns, strict=True):
            columns = out if len(self.parts) == 1 else out[:, a:b]
            if not columns.flags.c_contiguous:
                return super().matmul_calls(x, out)
            calls.append(
                quant_kernels.matmul_call(
                    x,
                    part.raw,
                    part.qtype,
                    part.rows,
                    self._in_features,
                    columns,
                    activations=self.activations,
                )
            )
        return calls

    def matmul_into(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """:meth:`HostLinear.matmul_into` (``quant_kernels.matmul``
        checks the arrays). A weight of several types writes each part's
        columns; at one row those columns are contiguous and take the
        kernel's output directly."""
        if len(self.parts) == 1:
            part = self.parts[0]
            quant_kernels.matmul(
                x,
                part.raw,
                part.qtype,
                part.rows,
                self._in_features,
                out=out,
                activations=self.activations,
            )
            return out
        for part, (a, b) in zip(self.parts, self._columns, strict=True):
            columns = out[:, a:b]
            direct = columns.flags.c_contiguous
            result = quant_kernels.matmul(
                x,
                part.raw,
                part.qtype,
                part.rows,
                self._in_features,
                out=columns if direct else None,
                activations=self.activations,
            )
            if not direct:
                columns[...] = result
        return out


@attrs.define(eq=False)
class QuantizedEmbedding:
    """A token embedding ``(V, H)`` kept in GGML block rows: a lookup
    dequantizes the rows of its ids, exactly as the file's float32
    dequantization would (``quant_kernels.dequantize_rows``). A float32
    table of SmolLM2's 49152 x 576 embedding was 113 MB of a 98 MB file's
    process; its Q8_0 rows (30 MB) are the tied head's own, read once."""

    part: QuantizedPart
    hidden: int

    def __attrs_post_init__(self) -> None:
        quant_kernels.row_bytes(self.part.qtype, self.hidden)  # checks the type

    @property
    def dtype(self) -> Any:
        """What a lookup returns: float32."""
        return paddle.float32

    @property
    def shape(self) -> list[int]:
        return [self.part.rows, self.hidden]

    def lookup(self, ids: paddle.Tensor) -> paddle.Tensor:  # (T,) -> (T, H)
        """The rows of ``ids`` as float32; an id outside the vocabulary
        raises IndexError (numpy's indexing checks it)."""
        index = ids.numpy()
        # host_tensor: paddle.to_tensor leaked a little on every step's call
        return host_tensor(
            self.lookup_into(index, np.empty((len(index), self.hidden), np.float32))
        )

    def lookup_into(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """:meth:`lookup` of host ids into ``out (T, H)`` float32."""
        rows = self.part.raw[ids]  # (T, row_bytes), a copy
        return quant_kernels.dequantize_rows(
            rows, self.part.qtype, self.hidden, out=out
        )


def quantized_linears(linears: Iterable[tuple[str, Linear]]) -> list[QuantizedLinear]:
    """The :class:`QuantizedLinear` among named Linears (``weights.linears()``)."""
    return [lin for _, lin in linears if isinstance(lin, QuantizedLinear)]


def set_activations(linears: Iterable[tuple[str, Linear]], activations: str) -> None:
    """Every quantized Linear of ``linears`` takes ``activations`` ("float" or
    "q8"); refuses another value (:class:`EngineConfigError` on
    ``quantized_activations``)."""
    if activations not in ACTIVATIONS:
        raise EngineConfigError(
            f"quantized_activations must be one of {', '.join(ACTIVATIONS)}, "
            f"not {activations!r}",
            field="quantized_activations",
        )
    for lin in quantized_linears(linears):
        lin.activations = activations


def warm_up(linears: Iterable[tuple[str, Linear]]) -> None:
    """Compile (or load from numba's disk cache) every kernel variant the
    quantized Linears among ``linears`` will call, at load: without it, the
    first step that reached a variant paused to compile it (a first compile
    on a machine takes 30 s to minutes; from the cache, about a second)."""
    found = quantized_linears(linears)
    if found:
        quant_kernels.warm_up(q8=any(lin.activations == "q8" for lin in found))
