# ruff: noqa: E741  (the loop variable is `l`, as in the C)
"""Scalar dequantizers that follow llama.cpp's C loops statement by statement.

``ggml/src/ggml-quants.c``'s ``dequantize_row_*`` read one block at a time
with float32 arithmetic; these do the same with numpy float32 scalars (so each
product rounds as the C one does) on one block's bytes. Slow, and written for
being checked against the C by eye, not for use: the vectorised dequantizers
of ``structllm.formats.quants`` are tested against them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

F32 = np.float32


def _f16(b: bytes, at: int) -> np.float32:
    return F32(np.frombuffer(b, dtype="<f2", count=1, offset=at)[0])


def _f32_from_bits(bits: int) -> np.float32:
    return F32(np.array([bits], dtype="<u4").view("<f4")[0])


def f32(b: bytes) -> list[np.float32]:
    return [_f32_from_bits(struct.unpack("<I", b)[0])]


def f16(b: bytes) -> list[np.float32]:
    return [_f16(b, 0)]


def bf16(b: bytes) -> list[np.float32]:
    return [_f32_from_bits(struct.unpack("<H", b)[0] << 16)]


def f64(b: bytes) -> list[np.float32]:
    return [F32(struct.unpack("<d", b)[0])]


def q4_0(b: bytes) -> list[np.float32]:
    d, qs = _f16(b, 0), b[2:18]
    y = [F32(0)] * 32
    for j in range(16):
        y[j] = F32((qs[j] & 0x0F) - 8) * d
        y[j + 16] = F32((qs[j] >> 4) - 8) * d
    return y


def q4_1(b: bytes) -> list[np.float32]:
    d, m, qs = _f16(b, 0), _f16(b, 2), b[4:20]
    y = [F32(0)] * 32
    for j in range(16):
        y[j] = F32(qs[j] & 0x0F) * d + m
        y[j + 16] = F32(qs[j] >> 4) * d + m
    return y


def q5_0(b: bytes) -> list[np.float32]:
    d = _f16(b, 0)
    (qh,) = struct.unpack("<I", b[2:6])
    qs = b[6:22]
    y = [F32(0)] * 32
    for j in range(16):
        xh_0 = ((qh >> j) << 4) & 0x10
        xh_1 = (qh >> (j + 12)) & 0x10
        y[j] = F32(((qs[j] & 0x0F) | xh_0) - 16) * d
        y[j + 16] = F32(((qs[j] >> 4) | xh_1) - 16) * d
    return y


def q5_1(b: bytes) -> list[np.float32]:
    d, m = _f16(b, 0), _f16(b, 2)
    (qh,) = struct.unpack("<I", b[4:8])
    qs = b[8:24]
    y = [F32(0)] * 32
    for j in range(16):
        xh_0 = ((qh >> j) << 4) & 0x10
        xh_1 = (qh >> (j + 12)) & 0x10
        y[j] = F32((qs[j] & 0x0F) | xh_0) * d + m
        y[j + 16] = F32((qs[j] >> 4) | xh_1) * d + m
    return y


def q8_0(b: bytes) -> list[np.float32]:
    d = _f16(b, 0)
    return [F32(q) * d for q in struct.unpack("<32b", b[2:34])]


def q2_k(b: bytes) -> list[np.float32]:
    scales, qs = b[0:16], b[16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    y: list[np.float32] = []
    i_s = 0
    for n in range(2):
        q = qs[32 * n : 32 * n + 32]
        for shift in (0, 2, 4, 6):
            for half in range(2):
                sc = scales[i_s]
                i_s += 1
                dl, ml = d * F32(sc & 0xF), dmin * F32(sc >> 4)
                for l in range(16):
                    y.append(dl * F32((q[l + 16 * half] >> shift) & 3) - ml)
    return y


def q3_k(b: bytes) -> list[np.float32]:
    hm, qs, packed = b[0:32], b[32:96], b[96:108]
    d_all = _f16(b, 108)
    kmask1, kmask2 = 0x03030303, 0x0F0F0F0F
    aux = [*struct.unpack("<3I", packed), 0]
    tmp = aux[2]
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4)
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4)
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4)
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4)
    scales = struct.unpack("<16b", struct.pack("<4I", *aux))
    y: list[np.float32] = []
    i_s, m = 0, 1
    for n in range(2):
        q = qs[32 * n : 32 * n + 32]
        for shift in (0, 2, 4, 6):
            for half in range(2):
                dl = d_all * F32(scales[i_s] - 32)
                i_s += 1
                for l in range(16 * half, 16 * half + 16):
                    hi = 0 if hm[l] & m else 4
                    y.append(dl * F32(((q[l] >> shift) & 3) - hi))
            m <<= 1
    return y


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | (
        (q[j] >> 6) << 4
    )


def q4_k(b: bytes) -> list[np.float32]:
    d, dmin, scales, qs = _f16(b, 0), _f16(b, 2), b[4:16], b[16:144]
    y: list[np.float32] = []
    for c in range(4):
        q = qs[32 * c : 32 * c + 32]
        sc, m = _scale_min_k4(2 * c, scales)
        d1, m1 = d * F32(sc), dmin * F32(m)
        sc, m = _scale_min_k4(2 * c + 1, scales)
        d2, m2 = d * F32(sc), dmin * F32(m)
        y += [d1 * F32(q[l] & 0xF) - m1 for l in range(32)]
        y += [d2 * F32(q[l] >> 4) - m2 for l in range(32)]
    return y


def q5_k(b: bytes) -> list[np.float32]:
    d, dmin, scales = _f16(b, 0), _f16(b, 2), b[4:16]
    qh, qs = b[16:48], b[48:176]
    y: list[np.float32] = []
    u1, u2 = 1, 2
    for c in range(4):
        ql = qs[32 * c : 32 * c + 32]
        sc, m = _scale_min_k4(2 * c, scales)
        d1, m1 = d * F32(sc), dmin * F32(m)
        sc, m = _scale_min_k4(2 * c + 1, scales)
        d2, m2 = d * F32(sc), dmin * F32(m)
        y += [
            d1 * F32((ql[l] & 0xF) + (16 if qh[l] & u1 else 0)) - m1 for l in range(32)
        ]
        y += [
            d2 * F32((ql[l] >> 4) + (16 if qh[l] & u2 else 0)) - m2 for l in range(32)
        ]
        u1 <<= 2
        u2 <<= 2
    return y


def q6_k(b: bytes) -> list[np.float32]:
    d = _f16(b, 208)
    sc_all = struct.unpack("<16b", b[192:208])
    y = [F32(0)] * 256
    for n in range(2):
        ql, qh = b[64 * n : 64 * n + 64], b[128 + 32 * n : 128 + 32 * n + 32]
        sc = sc_all[8 * n : 8 * n + 8]
        base = 128 * n
        for l in range(32):
            i_s = l // 16
            q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32
            y[base + l] = d * F32(sc[i_s]) * F32(q1)
            y[base + l + 32] = d * F32(sc[i_s + 2]) * F32(q2)
            y[base + l + 64] = d * F32(sc[i_s + 4]) * F32(q3)
            y[base + l + 96] = d * F32(sc[i_s + 6]) * F32(q4)
    return y


BLOCK_DEQUANTIZERS: dict[str, Callable[[bytes], list[np.float32]]] = {
    "F32": f32,
    "F16": f16,
    "BF16": bf16,
    "F64": f64,
    "Q4_0": q4_0,
    "Q4_1": q4_1,
    "Q5_0": q5_0,
    "Q5_1": q5_1,
    "Q8_0": q8_0,
    "Q2_K": q2_k,
    "Q3_K": q3_k,
    "Q4_K": q4_k,
    "Q5_K": q5_k,
    "Q6_K": q6_k,
}


def dequantize_blocks(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """(n, bytes_per_block) uint8 -> (n, values_per_block) float32."""
    fn = BLOCK_DEQUANTIZERS[type_name]
    with np.errstate(all="ignore"):
        return np.array([fn(row.tobytes()) for row in blocks], dtype=np.float32)
