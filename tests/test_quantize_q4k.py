# ruff: noqa: E741  (the loop variable is `l`, as in the C)
"""The Q4_K quantizer (``quantize.quantize(w, Q4_K)``) against llama.cpp's
``quantize_row_q4_K_ref``, transcribed below statement by statement; and
``quantization="q4_k"`` at load, llama.cpp's Q4_K_M mix of Q4_K and Q6_K.

gguf-py has no Q4_K quantizer to compare bytes with, so the oracle is the C
itself: :func:`c_quantize_row_q4_k` follows ``ggml/src/ggml-quants.c``'s loops
with numpy float32 scalars (each operation rounds as the C's does, compiled
without fused multiply-adds). It is slow (a few blocks a second) and written
to be checked against the C by eye; the vectorised quantizer must write the
same bytes. Its dequantized values are read back with gguf-py's
``gguf.quants.dequantize``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from structllm.model import quant_kernels as qk
from structllm.model import quantize as qz
from structllm.model.loader import load_model
from structllm.models import make_tiny_model
from tests.test_gguf_loading import _logits

F32 = np.float32
Q4_K = qk.GGMLType.Q4_K


def nearest_int(fval: np.float32) -> int:
    val = F32(fval + F32(12582912.0))
    i = int(np.array([val], np.float32).view(np.int32)[0])
    return (i & 0x007FFFFF) - 0x00400000


def make_qkx2_quants(
    n: int,
    nmax: int,
    x: list[np.float32],
    weights: list[np.float32],
    L: list[int],
    rmin: float,
    rdelta: float,
    nstep: int,
) -> tuple[np.float32, np.float32]:
    """(scale, the_min); ``use_mad`` false, as Q4_K calls it."""
    min_ = x[0]
    max_ = x[0]
    sum_w = weights[0]
    sum_x = F32(sum_w * x[0])
    for i in range(1, n):
        if x[i] < min_:
            min_ = x[i]
        if x[i] > max_:
            max_ = x[i]
        w = weights[i]
        sum_w = F32(sum_w + w)
        sum_x = F32(sum_x + F32(w * x[i]))
    if min_ > 0:
        min_ = F32(0)
    if max_ == min_:
        for i in range(n):
            L[i] = 0
        return F32(0), F32(-min_)
    iscale = F32(F32(nmax) / F32(max_ - min_))
    scale = F32(F32(1) / iscale)
    best_error = F32(0)
    for i in range(n):
        l = nearest_int(F32(iscale * F32(x[i] - min_)))
        L[i] = max(0, min(nmax, l))
        diff = F32(F32(F32(scale * F32(L[i])) + min_) - x[i])
        diff = F32(diff * diff)
        best_error = F32(best_error + F32(weights[i] * diff))
    Laux = [0] * n
    for is_ in range(nstep + 1):
        step = F32(F32(F32(rmin) + F32(F32(rdelta) * F32(is_))) + F32(nmax))
        iscale = F32(step / F32(max_ - min_))
        sum_l = sum_l2 = sum_xl = F32(0)
        for i in range(n):
            l = nearest_int(F32(iscale * F32(x[i] - min_)))
            l = max(0, min(nmax, l))
            Laux[i] = l
            w = weights[i]
            wl = F32(w * F32(l))
            sum_l = F32(sum_l + wl)
            sum_l2 = F32(sum_l2 + F32(wl * F32(l)))
            sum_xl = F32(sum_xl + F32(wl * x[i]))
        D = F32(F32(sum_w * sum_l2) - F32(sum_l * sum_l))
        if D > 0:
            this_scale = F32(F32(F32(sum_w * sum_xl) - F32(sum_x * sum_l)) / D)
            this_min = F32(F32(F32(sum_l2 * sum_x) - F32(sum_l * sum_xl)) / D)
            if this_min > 0:
                this_min = F32(0)
                this_scale = F32(sum_xl / sum_l2)
            cur_error = F32(0)
            for i in range(n):
                diff = F32(F32(F32(this_scale * F32(Laux[i])) + this_min) - x[i])
                diff = F32(diff * diff)
                cur_error = F32(cur_error + F32(weights[i] * diff))
            if cur_error < best_error:
                L[:] = Laux
                best_error = cur_error
                scale = this_scale
                min_ = this_min
    return scale, F32(-min_)


def get_scale_min_k4(j: int, q: list[int]) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | (
        (q[j] >> 6) << 4
    )


def _fp16(v: np.float32) -> np.float16:
    return np.float16(v)  # round to nearest even, as F16C's vcvtps2ph


def c_quantize_row_q4_k(x: np.ndarray) -> bytes:
    """``quantize_row_q4_K_ref`` of a float32 row of whole super-blocks."""
    out = bytearray()
    xs = [F32(v) for v in x]
    for i in range(len(xs) // 256):
        xb = xs[256 * i : 256 * i + 256]
        L = [0] * 256
        mins = [F32(0)] * 8
        scales = [F32(0)] * 8
        max_scale = F32(0)
        max_min = F32(0)
        for j in range(8):
            sub = xb[32 * j : 32 * j + 32]
            sum_x2 = F32(0)
            for l in range(32):
                sum_x2 = F32(sum_x2 + F32(sub[l] * sub[l]))
            av_x = F32(np.sqrt(F32(sum_x2 / F32(32))))
            weights = [F32(av_x + F32(abs(v))) for v in sub]
            Lj = [0] * 32
            scales[j], mins[j] = make_qkx2_quants(
                32, 15, sub, weights, Lj, -1.0, 0.1, 20
            )
            L[32 * j : 32 * j + 32] = Lj
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        inv_scale = F32(F32(63) / max_scale) if max_scale > 0 else F32(0)
        inv_min = F32(F32(63) / max_min) if max_min > 0 else F32(0)
        sc = [0] * 12
        for j in range(8):
            ls = min(63, nearest_int(F32(inv_scale * scales[j])) & 0xFF)
            lm = min(63, nearest_int(F32(inv_min * mins[j])) & 0xFF)
            if j < 4:
                sc[j] = ls
                sc[j + 4] = lm
            else:
                sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
                sc[j - 4] |= (ls >> 4) << 6
                sc[j] |= (lm >> 4) << 6
        d16 = _fp16(F32(max_scale / F32(63)))
        dmin16 = _fp16(F32(max_min / F32(63)))
        for j in range(8):
            s, m = get_scale_min_k4(j, sc)
            d = F32(F32(d16) * F32(s))
            if not d:
                continue
            dm = F32(F32(dmin16) * F32(m))
            for ii in range(32):
                l = nearest_int(F32(F32(xb[32 * j + ii] + dm) / d))
                L[32 * j + ii] = max(0, min(15, l))
        qs = [0] * 128
        for c in range(4):
            for l in range(32):
                qs[32 * c + l] = L[64 * c + l] | (L[64 * c + l + 32] << 4)
        out += d16.tobytes() + dmin16.tobytes() + bytes(sc) + bytes(qs)
    return bytes(out)


def _rows(kind: str, rows: int, n: int, seed: int) -> np.ndarray:
    """Weights as checkpoints hold them, and the corner cases of the C."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.uniform(-1, 1, (rows, n)).astype(np.float32)
    if kind == "gaussian":
        return (0.02 * rng.standard_normal((rows, n))).astype(np.float32)
    if kind == "heavy":  # Student's t, 3 degrees of freedom: outliers
        return (0.02 * rng.standard_t(3, (rows, n))).astype(np.float32)
    w = (0.02 * rng.standard_normal((rows, n))).astype(np.float32)
    w[0, :32] = 0  # an all-zero sub-block
    w[0, 32:64] = -0.25  # one negative value throughout (max == min)
    w[0, 64:96] = 0.5  # one positive value throughout (min clamps to 0)
    w[0, 96:128] += 3  # all positive, far from zero
    w[0, 128:160] *= 1e-6  # a scale of ~0 beside the others (6-bit scale 0)
    w[0, 160:192] = rng.uniform(0.5, 1.5, 32)  # positive: the fit's min > 0
    w[1, :256] = 0  # an all-zero super-block
    w[2, :] = np.round(w[2, :] * 100) / 100  # repeated values (ties)
    w[3, 5] = 40  # one large outlier
    return w


@pytest.mark.parametrize("kind", ["uniform", "gaussian", "heavy", "corners"])
def test_bytes_equal_llama_cpps_reference(kind: str) -> None:
    w = _rows(kind, 4, 512, seed=len(kind))
    raw = qz.quantize(w, Q4_K)
    assert raw.shape == (4, 2 * 144) and raw.dtype == np.uint8
    for r in range(w.shape[0]):
        assert raw[r].tobytes() == c_quantize_row_q4_k(w[r]), f"row {r}"


def _rms_error(w: np.ndarray, qtype: qk.GGMLType) -> float:
    raw = qz.quantize(w, qtype)
    back = np.asarray(
        gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype))), np.float32
    )
    assert back.shape == w.shape
    return float(np.sqrt(np.mean((back - w) ** 2)) / np.sqrt(np.mean(w**2)))


@pytest.mark.parametrize("kind", ["uniform", "gaussian", "heavy"])
def test_the_error_sits_between_q4_1s_and_q8_0s(kind: str) -> None:
    """Q4_K's searched scale and min per 32 values beat Q4_1's min/max (5 bits
    a value against Q4_K's 4.5) by 5-10%, Q4_1 beats Q4_0, Q8_0 beats them
    all by more than 8x; relative RMS errors here: uniform 5.5%, Gaussian
    7.1%, heavy-tailed 9.3% (Q4_1: 6.1, 7.8, 10.1%)."""
    w = _rows(kind, 64, 1024, seed=3)
    q4_k = _rms_error(w, Q4_K)
    q4_1 = _rms_error(w, qk.GGMLType.Q4_1)
    q4_0 = _rms_error(w, qk.GGMLType.Q4_0)
    q8_0 = _rms_error(w, qk.GGMLType.Q8_0)
    assert q8_0 * 8 < q4_k < 0.95 * q4_1
    assert q4_1 < q4_0
    assert 0.04 < q4_k < 0.1


def test_it_is_a_vectorised_pass_not_a_loop_over_blocks() -> None:
    """A SmolLM2-sized projection (576 x 1536) quantizes in well under a
    second: the work is a few dozen numpy passes over all sub-blocks."""
    w = _rows("gaussian", 576, 1536, seed=5)
    start = time.perf_counter()
    raw = qz.quantize(w, Q4_K)
    assert time.perf_counter() - start < 5  # ~0.2 s on a 2-core CI machine
    back = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K))
    np.testing.assert_array_equal(back, qk.dequantize_rows(raw, Q4_K, 1536))
    # chunks join seamlessly: each row's bytes are its own quantization's
    np.testing.assert_array_equal(raw[300:301], qz.quantize(w[300:301], Q4_K))


def test_rows_must_be_whole_super_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of Q4_K's 256"):
        qz.quantize(np.zeros((2, 128), np.float32), Q4_K)


def test_non_finite_weights_spoil_only_their_super_block() -> None:
    """A NaN or infinity quantizes without a warning (the C computes on), and
    the other super-blocks' bytes are unchanged."""
    w = _rows("gaussian", 2, 512, seed=9)
    bad = w.copy()
    bad[0, 3] = np.nan  # row 0, super-block 0
    bad[1, 300] = np.inf  # row 1, super-block 1
    raw, spoilt = qz.quantize(w, Q4_K), qz.quantize(bad, Q4_K)
    np.testing.assert_array_equal(spoilt[0, 144:], raw[0, 144:])
    np.testing.assert_array_equal(spoilt[1, :144], raw[1, :144])


# -- quantization="q4_k" at load: llama.cpp's Q4_K_M mix ------------------------


def _types(lin: Any) -> list[tuple[str, int]]:
    """A quantized Linear's runs of rows: ``[(type name, rows), ...]``."""
    return [(qk.GGMLType(p.qtype).name, p.rows) for p in lin.parts]


def _eight_layers(tmp_path: Path) -> Path:
    make_tiny_model(
        tmp_path,
        arch="llama",
        hidden_size=256,
        num_layers=8,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
        seed=3,
    )
    return tmp_path


def test_q4_k_at_load_puts_q6_k_where_q4_k_m_does(tmp_path: Path) -> None:
    """Of 8 layers, 0, 3, 6 and 7 (the first and last eighth, every third
    between) hold v_proj and down_proj in Q6_K, as does the head; every
    other projection is Q4_K (rows of 256 inputs: no fallback)."""
    model = load_model(_eight_layers(tmp_path), quantization="q4_k").model
    for n, layer in enumerate(model.weights.layers):
        more = n in (0, 3, 6, 7)
        # q: 4 heads x 64, k and v: 2 x 64 rows each; v's rows are the last
        qkv = [("Q4_K", 384), ("Q6_K", 128)] if more else [("Q4_K", 512)]
        assert _types(layer.qkv) == qkv, n
        assert _types(layer.o) == [("Q4_K", 256)]
        assert _types(layer.gate_up) == [("Q4_K", 1024)]
        assert _types(layer.down) == [("Q6_K" if more else "Q4_K", 256)], n
    assert _types(model.weights.lm_head) == [("Q6_K", 512)]


def test_the_mix_is_closer_to_float_than_q4_k_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The logits' relative RMS error against the float model: 0.26 with
    the Q4_K_M mix, 0.30 with every weight Q4_K (0.82-0.90x on six random
    checkpoints; Q8_0 0.02), and the greedy token at 8 of the prompt's 9
    positions is the float model's (6 of 9 with Q4_K alone). The tiny random
    model's logits are near-flat: the bench and real models are measured in
    docs/models.md."""
    directory = _eight_layers(tmp_path)
    want = _logits(load_model(directory).model)
    mix = _logits(load_model(directory, quantization="q4_k").model)
    monkeypatch.setattr(qz, "tensor_type", lambda *_: qk.GGMLType.Q4_K)
    alone = _logits(load_model(directory, quantization="q4_k").model)

    def error(got: np.ndarray) -> float:
        return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))

    assert error(mix) < 0.95 * error(alone)
    assert error(mix) < 0.3
    agree = np.mean(mix.argmax(axis=-1) == want.argmax(axis=-1))
    assert agree >= 7 / 9
