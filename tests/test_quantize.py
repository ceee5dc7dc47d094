# ruff: noqa: E741  (the loop variable is `l`, as in the C)
"""The Q6_K quantizer (``quantize.quantize(w, Q6_K)``) against llama.cpp's
``quantize_row_q6_K_ref``, transcribed below statement by statement, and the
per-weight types of ``quantization="q4_k"`` (llama.cpp's Q4_K_M mix).

gguf-py has no Q6_K quantizer, so the oracle is the C itself, as for Q4_K
(tests/test_quantize_q4k.py): :func:`c_quantize_row_q6_k` follows
``ggml/src/ggml-quants.c`` with numpy float32 scalars (each operation
rounding as the C's does, compiled without fused multiply-adds). The
vectorised quantizer must write the same bytes; they are read back with
gguf-py's ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from structllm.model import quant_kernels as qk
from structllm.model import quantize as qz
from tests.test_quantize_q4k import _fp16, _rows, nearest_int

gguf = pytest.importorskip("gguf")

F32 = np.float32
G = qk.GGMLType
Q6_K = G.Q6_K


def make_qx_quants(n: int, nmax: int, x: list[np.float32], L: list[int]) -> np.float32:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL)``: weights x^2."""
    max_ = F32(0)
    amax = F32(0)
    for i in range(n):
        ax = F32(abs(x[i]))
        if ax > amax:
            amax = ax
            max_ = x[i]
    if amax < F32(1e-15):
        for i in range(n):
            L[i] = 0
        return F32(0)
    iscale = F32(F32(-nmax) / max_)
    sumlx = F32(0)
    suml2 = F32(0)
    for i in range(n):
        l = nearest_int(F32(iscale * x[i]))
        l = max(-nmax, min(nmax - 1, l))
        L[i] = l + nmax
        w = F32(x[i] * x[i])
        sumlx = F32(sumlx + F32(F32(w * x[i]) * F32(l)))
        suml2 = F32(suml2 + F32(F32(w * F32(l)) * F32(l)))
    scale = F32(sumlx / suml2) if suml2 else F32(0)
    best = F32(scale * sumlx)
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        iscale = F32(F32(-F32(F32(nmax) + F32(F32(0.1) * F32(is_)))) / max_)
        sumlx = suml2 = F32(0)
        for i in range(n):
            l = nearest_int(F32(iscale * x[i]))
            l = max(-nmax, min(nmax - 1, l))
            w = F32(x[i] * x[i])
            sumlx = F32(sumlx + F32(F32(w * x[i]) * F32(l)))
            suml2 = F32(suml2 + F32(F32(w * F32(l)) * F32(l)))
        if suml2 > 0 and F32(sumlx * sumlx) > F32(best * suml2):
            for i in range(n):
                l = nearest_int(F32(iscale * x[i]))
                L[i] = nmax + max(-nmax, min(nmax - 1, l))
            scale = F32(sumlx / suml2)
            best = F32(scale * sumlx)
    return scale


def c_quantize_row_q6_k(x: np.ndarray) -> bytes:
    """``quantize_row_q6_K_ref`` of a float32 row of whole super-blocks."""
    out = bytearray()
    xs = [F32(v) for v in x]
    for i in range(len(xs) // 256):
        xb = xs[256 * i : 256 * i + 256]
        L = [0] * 256
        scales = [F32(0)] * 16
        max_scale = F32(0)
        max_abs_scale = F32(0)
        for ib in range(16):
            Lb = [0] * 16
            scale = make_qx_quants(16, 32, xb[16 * ib : 16 * ib + 16], Lb)
            L[16 * ib : 16 * ib + 16] = Lb
            scales[ib] = scale
            abs_scale = F32(abs(scale))
            if abs_scale > max_abs_scale:
                max_abs_scale = abs_scale
                max_scale = scale
        if max_abs_scale < F32(1e-15):
            out += bytes(210)
            continue
        iscale = F32(F32(-128) / max_scale)
        d16 = _fp16(F32(F32(1) / iscale))
        sc = [min(127, nearest_int(F32(iscale * scales[ib]))) for ib in range(16)]
        sc = [((s + 128) % 256) - 128 for s in sc]  # stored in an int8
        for j in range(16):
            d = F32(F32(d16) * F32(sc[j]))
            if not d:
                continue
            for ii in range(16):
                l = nearest_int(F32(xb[16 * j + ii] / d))
                L[16 * j + ii] = max(-32, min(31, l)) + 32
        ql = [0] * 128
        qh = [0] * 64
        for half in range(2):
            j = 128 * half
            for l in range(32):
                q1, q2 = L[j + l] & 0xF, L[j + l + 32] & 0xF
                q3, q4 = L[j + l + 64] & 0xF, L[j + l + 96] & 0xF
                ql[64 * half + l] = q1 | (q3 << 4)
                ql[64 * half + l + 32] = q2 | (q4 << 4)
                qh[32 * half + l] = (
                    (L[j + l] >> 4)
                    | ((L[j + l + 32] >> 4) << 2)
                    | ((L[j + l + 64] >> 4) << 4)
                    | ((L[j + l + 96] >> 4) << 6)
                )
        out += bytes(ql) + bytes(qh) + bytes(s & 0xFF for s in sc) + d16.tobytes()
    return bytes(out)


def _q6_k_corners() -> np.ndarray:
    """Q6_K's own corners beside Q4_K's: 16-value sub-blocks all zero, a tiny
    super-block (below the C's 1e-15 after the fit), a near-zero scale."""
    w = _rows("corners", 6, 512, seed=7)
    w[4, :16] = 0  # one zero sub-block among others
    w[4, 16:32] = -w[4, 16:32].max()  # the largest scale negative
    w[5, :256] *= 1e-16  # every sub-block's scale under GROUP_MAX_EPS
    w[5, 256:272] = 1e-30  # subnormal squares
    return w


@pytest.mark.parametrize("kind", ["uniform", "gaussian", "heavy", "corners"])
def test_bytes_equal_llama_cpps_reference(kind: str) -> None:
    w = _q6_k_corners() if kind == "corners" else _rows(kind, 3, 512, seed=len(kind))
    raw = qz.quantize(w, Q6_K)
    assert raw.shape == (w.shape[0], 2 * 210) and raw.dtype == np.uint8
    for r in range(w.shape[0]):
        assert raw[r].tobytes() == c_quantize_row_q6_k(w[r]), f"row {r}"


def _rms_error(w: np.ndarray, qtype: G) -> float:
    raw = qz.quantize(w, qtype)
    back = np.asarray(
        gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype))), np.float32
    )
    assert back.shape == w.shape
    return float(np.sqrt(np.mean((back - w) ** 2)) / np.sqrt(np.mean(w**2)))


@pytest.mark.parametrize("kind", ["uniform", "gaussian", "heavy"])
def test_the_error_sits_between_q4_ks_and_q8_0s(kind: str) -> None:
    """6.56 bits a value: relative RMS errors here uniform 1.3%, Gaussian
    1.8%, heavy-tailed 2.6% (Q4_K 5.5, 7.1, 9.2%; Q8_0 0.4-0.7%); the same
    as llama.cpp's own ``quantize_row_q6_K_ref`` (the same bytes)."""
    w = _rows(kind, 64, 1024, seed=3)
    q6_k = _rms_error(w, Q6_K)
    assert 2.5 * q6_k < _rms_error(w, G.Q4_K)
    assert _rms_error(w, G.Q8_0) < 0.5 * q6_k
    assert 0.01 < q6_k < 0.03


def test_it_is_a_vectorised_pass_not_a_loop_over_blocks() -> None:
    """A SmolLM2-sized down_proj (576 x 1536) quantizes in well under a
    second (~0.15 s here), read back as the kernels' dequantizer reads it."""
    w = _rows("gaussian", 576, 1536, seed=5)
    start = time.perf_counter()
    raw = qz.quantize(w, Q6_K)
    assert time.perf_counter() - start < 5
    back = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K))
    np.testing.assert_array_equal(back, qk.dequantize_rows(raw, Q6_K, 1536))
    np.testing.assert_array_equal(raw[300:301], qz.quantize(w[300:301], Q6_K))


def test_non_finite_weights_spoil_only_their_super_block() -> None:
    w = _rows("gaussian", 2, 512, seed=9)
    bad = w.copy()
    bad[0, 3] = np.nan
    bad[1, 300] = np.inf
    raw, spoilt = qz.quantize(w, Q6_K), qz.quantize(bad, Q6_K)
    np.testing.assert_array_equal(spoilt[0, 210:], raw[0, 210:])
    np.testing.assert_array_equal(spoilt[1, :210], raw[1, :210])


def test_rows_must_be_whole_super_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of Q6_K's 256"):
        qz.quantize(np.zeros((2, 128), np.float32), Q6_K)


# -- which type each weight gets ------------------------------------------------


def test_use_more_bits_is_llama_cpps_layer_rule() -> None:
    """The first and last eighth and every third layer between (llama.cpp's
    ``i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2``, integer division)."""
    more = {n: [i for i in range(n) if qz.use_more_bits(i, n)] for n in (2, 8, 30)}
    assert more[2] == [1]  # 2 // 8 = 0: only layer 1, by 7 * 2 // 8 = 1
    assert more[8] == [0, 3, 6, 7]
    # SmolLM2-135M: as its published Q4_K_M file holds ffn_down in Q6_K
    assert more[30] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]


@pytest.mark.parametrize(
    ("piece", "in_features", "want"),
    [
        ("lm_head", 512, G.Q6_K),
        ("model.embed_tokens", 512, G.Q6_K),  # a tied head
        ("lm_head", 576, G.Q8_0),  # not whole super-blocks: Q6_K's fallback
        ("model.layers.3.self_attn.v_proj", 512, G.Q6_K),
        ("model.layers.3.self_attn.v_proj", 576, G.Q8_0),
        ("model.layers.4.self_attn.v_proj", 512, G.Q4_K),
        ("model.layers.4.self_attn.v_proj", 576, G.Q5_0),  # Q4_K's fallback
        ("model.layers.6.mlp.down_proj", 1536, G.Q6_K),
        ("model.layers.5.mlp.down_proj", 1536, G.Q4_K),
        ("model.layers.0.self_attn.q_proj", 512, G.Q4_K),
        ("model.layers.0.mlp.gate_proj", 512, G.Q4_K),
    ],
)
def test_q4_k_is_the_q4_k_m_mix(piece: str, in_features: int, want: G) -> None:
    assert qz.tensor_type(G.Q4_K, piece, in_features, 8) == want


def test_other_types_are_every_weights() -> None:
    for kind in (G.Q8_0, G.Q4_0, G.Q4_1):
        for piece in ("lm_head", "model.layers.0.self_attn.v_proj"):
            assert qz.tensor_type(kind, piece, 576, 8) == kind
