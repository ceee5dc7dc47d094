"""GGML tensor types: their block layouts, and numpy dequantizers.

A GGML tensor is a sequence of *blocks*: each block holds a fixed number of
values (``values_per_block``) in a fixed number of bytes
(``bytes_per_block``), and a row (the innermost dimension, GGUF's ``ne[0]``)
is a whole number of blocks. Plain types (F32, F16, BF16, ...) are blocks of
one value. The layouts follow llama.cpp's ``ggml/src/ggml-common.h``; all
multi-byte fields are little-endian.

Dequantizers exist for F32, F16, BF16, F64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (:data:`DEQUANTIZABLE`). They compute in
float32 in the same order as llama.cpp's reference ``dequantize_row_*``
(a scale is ``d * sc`` first, then times the quant, then minus ``dmin * m``),
so the results are bit-identical to it (and to ``gguf-py``'s) wherever the C
compiler does not contract to fused multiply-adds. Every other known type has a
layout (so a file holding it opens and :func:`dequantize` refuses it by name).

The standard library alone: both the text and the model layers import
this module, and the server's front end reads a GGUF file's tokenizer
without numpy. The dequantizers are numpy's, in
:mod:`structllm.formats.blocks`, loaded by the first :func:`dequantize`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "DEQUANTIZABLE",
    "QK_K",
    "GGMLType",
    "block_layout",
    "dequantize",
    "tensor_nbytes",
]

QK_K = 256
"""Values in one K-quant super-block."""


class GGMLType(IntEnum):
    """A tensor's element type, with ``ggml.h``'s ``enum ggml_type`` numbers.

    Gaps are types llama.cpp removed (4, 5: Q4_2, Q4_3; 31-33, 36-38: the
    repacked Q4_0_x_x / IQ4_NL_x_x); a file naming them is refused.
    """

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


_T = GGMLType

# (values per block, bytes per block), from the block structs of ggml-common.h.
_LAYOUT: dict[GGMLType, tuple[int, int]] = {
    _T.F32: (1, 4),
    _T.F16: (1, 2),
    _T.BF16: (1, 2),
    _T.F64: (1, 8),
    _T.I8: (1, 1),
    _T.I16: (1, 2),
    _T.I32: (1, 4),
    _T.I64: (1, 8),
    # d (f16), 16 bytes of 4-bit quants
    _T.Q4_0: (32, 2 + 16),
    # d, m (f16), 16 bytes of 4-bit quants
    _T.Q4_1: (32, 2 + 2 + 16),
    # d (f16), qh (32 fifth bits), 16 bytes of low nibbles
    _T.Q5_0: (32, 2 + 4 + 16),
    # d, m (f16), qh, 16 bytes of low nibbles
    _T.Q5_1: (32, 2 + 2 + 4 + 16),
    # d (f16), 32 int8
    _T.Q8_0: (32, 2 + 32),
    # d, s (f32 each), 32 int8
    _T.Q8_1: (32, 4 + 4 + 32),
    # scales[16] (4-bit scale, 4-bit min), qs[64] (2-bit), d, dmin (f16)
    _T.Q2_K: (QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    # hmask[32], qs[64], scales[12] (16 packed 6-bit), d (f16)
    _T.Q3_K: (QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    # d, dmin (f16), scales[12] (8 6-bit scales, 8 6-bit mins), qs[128]
    _T.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    # d, dmin, scales[12], qh[32], qs[128]
    _T.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    # ql[128], qh[64], scales[16] (int8), d (f16)
    _T.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    # d (f32), qs[256] int8, bsums[16] int16
    _T.Q8_K: (QK_K, 4 + QK_K + QK_K // 16 * 2),
    _T.IQ2_XXS: (QK_K, 2 + QK_K // 4),
    _T.IQ2_XS: (QK_K, 2 + QK_K // 4 + QK_K // 32),
    _T.IQ3_XXS: (QK_K, 2 + QK_K // 4 + QK_K // 8),
    _T.IQ1_S: (QK_K, 2 + QK_K // 8 + QK_K // 16),
    _T.IQ4_NL: (32, 2 + 16),
    _T.IQ3_S: (QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    _T.IQ2_S: (QK_K, 2 + QK_K // 4 + QK_K // 16),
    _T.IQ4_XS: (QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
    _T.IQ1_M: (QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    _T.TQ1_0: (QK_K, 2 + 4 * 13),
    _T.TQ2_0: (QK_K, 2 + 64),
    _T.MXFP4: (32, 1 + 16),
    _T.NVFP4: (64, 4 + 32),
    _T.Q1_0: (128, 2 + 16),
}


def block_layout(type: GGMLType | int) -> tuple[int, int]:
    """``(values_per_block, bytes_per_block)`` of a GGML type.

    Raises ``ValueError`` for a number that is no known type.
    """
    return _LAYOUT[GGMLType(type)]


def tensor_nbytes(type: GGMLType | int, shape: Sequence[int]) -> int:
    """Bytes a tensor of this type and numpy-order ``shape`` occupies.

    Raises ``ValueError`` when the innermost dimension (GGUF's ``ne[0]``) is
    not a whole number of blocks, or a dimension is negative.
    """
    per_block, block_bytes = block_layout(type)
    if any(int(d) < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {tuple(shape)}")
    row = int(shape[-1]) if len(shape) else 1
    if row % per_block:
        raise ValueError(
            f"a row of {row} values is not a whole number of "
            f"{GGMLType(type).name} blocks of {per_block}"
        )
    return math.prod(int(d) for d in shape) // per_block * block_bytes


DEQUANTIZABLE: frozenset[GGMLType] = frozenset(
    (
        *(GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.F64),
        *(GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0),
        *(GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K),
    )
)
"""The types :func:`dequantize` converts."""


def dequantize(
    raw: npt.NDArray[np.uint8], type: GGMLType | int, shape: Sequence[int]
) -> npt.NDArray[np.float32]:
    """A tensor's values as a new, writable float32 array of numpy ``shape``.

    ``raw`` holds exactly the tensor's bytes (any contiguous array; it is read
    as bytes). Raises ``ModelLoadError`` for a type without a dequantizer and
    ``ValueError`` when ``raw`` does not hold ``shape``'s bytes.
    NaN and infinite scales give NaN and infinite values, silently.
    """
    from structllm.formats import blocks

    return blocks.dequantize(raw, type, shape)
