"""numpy's dequantizers of GGML blocks: :func:`structllm.formats.quants.dequantize`
loads this module on its first call (the layouts and types need no numpy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from structllm.errors import ModelLoadError
from structllm.formats.quants import (
    DEQUANTIZABLE,
    QK_K,
    GGMLType,
    block_layout,
    tensor_nbytes,
)

__all__ = ["dequantize"]

_T = GGMLType

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


# Values converted per step: the temporaries of one step stay in the cache.
_CHUNK_VALUES = 1 << 16


def dequantize(
    raw: npt.NDArray[np.uint8], type: GGMLType | int, shape: Sequence[int]
) -> npt.NDArray[np.float32]:
    """:func:`structllm.formats.quants.dequantize`, which calls this."""
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
    per_block, block_bytes = block_layout(kind)
    n_blocks = expected // block_bytes
    blocks = data.reshape(n_blocks, block_bytes)
    out = np.empty((n_blocks, per_block), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // per_block)
    with np.errstate(all="ignore"):  # inf * 0 in a corrupt block is not our error
        for start in range(0, n_blocks, step):
            fn(blocks[start : start + step], out[start : start + step])
    return out.reshape(shape)
