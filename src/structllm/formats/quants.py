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

Only numpy and the standard library: both the text and the model layers
import this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from structllm.errors import ModelLoadError

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


# -- dequantizers ------------------------------------------------------------------
#
# Each takes ``blocks`` (uint8, shape (n, bytes_per_block)) and writes the
# float32 values into ``out`` (shape (n, values_per_block), C-contiguous).

_U8 = np.uint8
_Blocks = npt.NDArray[np.uint8]
_Out = npt.NDArray[np.float32]

_NIBBLE_SHIFT = np.array([0, 4], dtype=_U8).reshape(1, 2, 1)
_CRUMB_SHIFT = np.array([0, 2, 4, 6], dtype=_U8).reshape(1, 4, 1)
_BIT_SHIFT = np.arange(8, dtype=_U8).reshape(1, 8, 1)


def _f16(blocks: _Blocks, at: int) -> npt.NDArray[np.float32]:
    """The little-endian f16 at byte ``at`` of every block, as (n, 1) float32."""
    return blocks[:, at : at + 2].view("<f2").astype(np.float32)


def _nibbles(qs: _Blocks) -> _Blocks:
    """(n, k) bytes -> (n, 2, k): low nibbles, then high nibbles."""
    return (qs[:, None, :] >> _NIBBLE_SHIFT) & _U8(0x0F)


def _bits(packed: _Blocks) -> _Blocks:
    """(n, k) bytes -> (n, 8, k): bit 0 of every byte, then bit 1, ..."""
    return (packed[:, None, :] >> _BIT_SHIFT) & _U8(1)


def _deq_f32(blocks: _Blocks, out: _Out) -> None:
    out[...] = blocks.view("<f4")


def _deq_f16(blocks: _Blocks, out: _Out) -> None:
    out[...] = blocks.view("<f2")


def _deq_f64(blocks: _Blocks, out: _Out) -> None:
    out[...] = blocks.view("<f8")


def _deq_bf16(blocks: _Blocks, out: _Out) -> None:
    # bfloat16 is the high half of a float32: NaN payloads survive.
    bits = out.view(np.uint32)
    bits[...] = blocks.view("<u2")
    bits <<= np.uint32(16)


def _deq_q4_0(blocks: _Blocks, out: _Out) -> None:
    # value j: (nibble - 8) * d; j < 16 low nibble of byte j, else high of j-16
    out.reshape(-1, 2, 16)[...] = _nibbles(blocks[:, 2:18])
    out -= np.float32(8)
    out *= _f16(blocks, 0)


def _deq_q4_1(blocks: _Blocks, out: _Out) -> None:
    # d * nibble + m
    out.reshape(-1, 2, 16)[...] = _nibbles(blocks[:, 4:20])
    out *= _f16(blocks, 0)
    out += _f16(blocks, 2)


def _five_bit(qh: _Blocks, qs: _Blocks) -> _Blocks:
    """Q5_0/Q5_1 quants: value j's fifth bit is bit j of the 32-bit qh."""
    high = np.unpackbits(qh, axis=1, bitorder="little")  # (n, 32), bit j
    return _nibbles(qs).reshape(-1, 32) | (high << _U8(4))


def _deq_q5_0(blocks: _Blocks, out: _Out) -> None:
    out[...] = _five_bit(blocks[:, 2:6], blocks[:, 6:22])
    out -= np.float32(16)
    out *= _f16(blocks, 0)


def _deq_q5_1(blocks: _Blocks, out: _Out) -> None:
    out[...] = _five_bit(blocks[:, 4:8], blocks[:, 8:24])
    out *= _f16(blocks, 0)
    out += _f16(blocks, 2)


def _deq_q8_0(blocks: _Blocks, out: _Out) -> None:
    out[...] = blocks[:, 2:34].view(np.int8)
    out *= _f16(blocks, 0)


def _two_bit(qs: _Blocks) -> _Blocks:
    """Q2_K/Q3_K low quants, (n, 64) -> (n, 256) in value order.

    Value ``128*h + 32*j + l`` is bits ``2j, 2j+1`` of byte ``32*h + l``.
    """
    return ((qs.reshape(-1, 2, 1, 32) >> _CRUMB_SHIFT[:, None]) & _U8(3)).reshape(
        -1, QK_K
    )


def _deq_q2_k(blocks: _Blocks, out: _Out) -> None:
    # 16 sub-blocks of 16: (d * (sc & 15)) * q - dmin * (sc >> 4)
    scales = blocks[:, 0:16]
    d = _f16(blocks, 80)
    dmin = _f16(blocks, 82)
    scale = d * (scales & _U8(0x0F)).astype(np.float32)
    low = dmin * (scales >> _U8(4)).astype(np.float32)
    sub = out.reshape(-1, 16, 16)
    sub[...] = _two_bit(blocks[:, 16:80]).reshape(-1, 16, 16)
    sub *= scale[:, :, None]
    sub -= low[:, :, None]


def _q3_k_scales(packed: _Blocks) -> _Blocks:
    """Q3_K's 16 6-bit scales from 12 bytes (unsigned, offset by 32).

    Scale i: low 4 bits are nibble ``i // 8`` of byte ``i % 8``; high 2 bits
    are bits ``2*(i//4)`` of byte ``8 + i % 4``.
    """
    low = _nibbles(packed[:, 0:8]).reshape(-1, 16)
    high = ((packed[:, None, 8:12] >> _CRUMB_SHIFT) & _U8(3)).reshape(-1, 16)
    return low | (high << _U8(4))


def _deq_q3_k(blocks: _Blocks, out: _Out) -> None:
    # 16 sub-blocks of 16: (d * (scale - 32)) * (q2 - (4 if hmask bit clear else 0))
    # value 32*k + l (k = 4h + j) takes its high bit from bit k of hmask[l]
    hmask = blocks[:, 0:32]
    d = _f16(blocks, 108)
    scale = d * (_q3_k_scales(blocks[:, 96:108]).astype(np.float32) - np.float32(32))
    sub = out.reshape(-1, 16, 16)
    q = _two_bit(blocks[:, 32:96]).astype(np.int8)
    q -= ((_bits(hmask) ^ _U8(1)) << _U8(2)).reshape(-1, QK_K).view(np.int8)
    out[...] = q
    sub *= scale[:, :, None]


def _k4_scales_mins(
    packed: _Blocks,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Q4_K/Q5_K: 8 6-bit scales and 8 6-bit mins from 12 bytes.

    Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins);
    sub-blocks 4-7: a nibble of bytes 8-11, with the top two bits of bytes
    0-3 (scales) or 4-7 (mins) above it (llama.cpp's ``get_scale_min_k4``).
    """
    b0, b1, b2 = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    six = _U8(0x3F)
    scales = np.concatenate(
        [b0 & six, (b2 & _U8(0x0F)) | ((b0 >> _U8(6)) << _U8(4))], axis=1
    )
    mins = np.concatenate(
        [b1 & six, (b2 >> _U8(4)) | ((b1 >> _U8(6)) << _U8(4))], axis=1
    )
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_subblocks(blocks: _Blocks, out: _Out, q: _Blocks) -> None:
    """Q4_K/Q5_K: 8 sub-blocks of 32, ``(d * sc) * q - dmin * m``."""
    scales, mins = _k4_scales_mins(blocks[:, 4:16])
    sub = out.reshape(-1, 8, 32)
    sub[...] = q
    sub *= (_f16(blocks, 0) * scales)[:, :, None]
    sub -= (_f16(blocks, 2) * mins)[:, :, None]


def _deq_q4_k(blocks: _Blocks, out: _Out) -> None:
    # 64 values per 32 bytes: sub-block 2c the low nibbles, 2c+1 the high ones
    q = _nibbles(blocks[:, 16:144].reshape(-1, 32)).reshape(-1, 8, 32)
    _k_subblocks(blocks, out, q)


def _deq_q5_k(blocks: _Blocks, out: _Out) -> None:
    # as Q4_K, plus a fifth bit: sub-block s, value l takes bit s of qh[l]
    low = _nibbles(blocks[:, 48:176].reshape(-1, 32)).reshape(-1, 8, 32)
    q = low | (_bits(blocks[:, 16:48]) << _U8(4))
    _k_subblocks(blocks, out, q)


def _deq_q6_k(blocks: _Blocks, out: _Out) -> None:
    # two halves of 128; in half h, quarter k, value l (0..31):
    # low nibble: ql[64h + 32*(k%2) + l], nibble k//2;
    # high 2 bits: bits 2k of qh[32h + l];  y = (d * scales[e // 16]) * (q - 32)
    ql = blocks[:, 0:128].reshape(-1, 2, 64)
    qh = blocks[:, 128:192].reshape(-1, 2, 32)
    low = ((ql[:, :, None, :] >> _NIBBLE_SHIFT[:, None]) & _U8(0x0F)).reshape(
        -1, 2, 4, 32
    )
    high = (qh[:, :, None, :] >> _CRUMB_SHIFT[:, None]) & _U8(3)
    q = (low | (high << _U8(4))).view(np.int8) - np.int8(32)
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    out[...] = q.reshape(-1, QK_K)
    out.reshape(-1, 16, 16)[...] *= scale[:, :, None]


_DEQUANT: dict[GGMLType, Callable[[_Blocks, _Out], None]] = {
    _T.F32: _deq_f32,
    _T.F16: _deq_f16,
    _T.BF16: _deq_bf16,
    _T.F64: _deq_f64,
    _T.Q4_0: _deq_q4_0,
    _T.Q4_1: _deq_q4_1,
    _T.Q5_0: _deq_q5_0,
    _T.Q5_1: _deq_q5_1,
    _T.Q8_0: _deq_q8_0,
    _T.Q2_K: _deq_q2_k,
    _T.Q3_K: _deq_q3_k,
    _T.Q4_K: _deq_q4_k,
    _T.Q5_K: _deq_q5_k,
    _T.Q6_K: _deq_q6_k,
}

DEQUANTIZABLE: frozenset[GGMLType] = frozenset(_DEQUANT)
"""The types :func:`dequantize` converts."""

# Values converted per step: the temporaries of one step stay in the cache.
_CHUNK_VALUES = 1 << 16


def dequantize(
    raw: npt.NDArray[np.uint8], type: GGMLType | int, shape: Sequence[int]
) -> npt.NDArray[np.float32]:
    """A tensor's values as a new, writable float32 array of numpy ``shape``.

    ``raw`` holds exactly the tensor's bytes (any contiguous array; it is read
    as bytes). Raises ``ModelLoadError`` for a type without a dequantizer and
    ``ValueError`` when ``raw`` does not hold ``shape``'s bytes.
    NaN and infinite scales give NaN and infinite values, silently.
    """
    kind = GGMLType(type)
    shape = tuple(int(d) for d in shape)
    fn = _DEQUANT.get(kind)
    if fn is None:
        raise ModelLoadError(
            f"no dequantizer for GGML type {kind.name} ({int(kind)}); "
            f"supported: {', '.join(sorted(t.name for t in DEQUANTIZABLE))}"
        )
    expected = tensor_nbytes(kind, shape)
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if data.size != expected:
        raise ValueError(
            f"{kind.name} tensor of shape {shape} needs {expected} bytes, got {data.size}"
        )
    per_block, block_bytes = _LAYOUT[kind]
    n_blocks = expected // block_bytes
    blocks = data.reshape(n_blocks, block_bytes)
    out = np.empty((n_blocks, per_block), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // per_block)
    with np.errstate(all="ignore"):  # inf * 0 in a corrupt block is not our error
        for start in range(0, n_blocks, step):
            fn(blocks[start : start + step], out[start : start + step])
    return out.reshape(shape)
