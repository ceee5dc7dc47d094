"""q8 activations for the K-quants (Q4_K, Q6_K): ``x`` as llama.cpp's Q8_K
blocks and integer dot products, against a numpy model of that integer
arithmetic, against the float product, and the same for a token whatever
the call's ``T``."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from structllm.model import kernels
from structllm.model import quant_kernels as qk
from structllm.model import quantize as qz
from structllm.model.quant_kernels import GGMLType

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.skipif(not qk.available(), reason="numba is not installed")

KINDS = sorted(qk.Q8K_TYPES)


def random_raw(kind: GGMLType, rows: int, n: int, seed: int = 0) -> np.ndarray:
    """Random blocks of ``kind``: every byte random but the f16 scales
    (small and finite): every 6-bit scale and min, every int8 scale."""
    rng = np.random.default_rng(seed)
    values, size = qk.block_layout(kind)
    raw = rng.integers(0, 256, (rows, n // values, size), dtype=np.uint8)
    for at in (0, 2) if kind == GGMLType.Q4_K else (208,):
        halves = (rng.standard_normal((rows, n // values)) * 0.01).astype(np.float16)
        raw[:, :, at : at + 2] = halves.view(np.uint8).reshape(rows, n // values, 2)
    return raw.reshape(rows, -1)


def q8k_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_K blocks as llama.cpp's ``quantize_row_q8_K_ref`` makes them:
    ``q`` int64 ``(T, blocks, 256)`` and the float32 ``d`` ``(T, blocks)``:
    m the first value of the largest magnitude, ``iscale = -127 / m``, q
    ``x * iscale`` rounded half to even (its ``nearest_int``), at most 127,
    ``d = 1 / iscale``."""
    blocks = x.reshape(x.shape[0], -1, 256)
    top = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=2)[..., None], 2)
    top = top[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(top == 0, np.float32(0), np.float32(-127) / top)
        d = np.where(top == 0, np.float32(0), np.float32(1) / iscale)
    q = np.minimum(np.rint(blocks * iscale.astype(np.float32)[..., None]), 127)
    return q.astype(np.int64), d.astype(np.float32)


def test_q8k_blocks_as_llama_cpp_makes_them() -> None:
    """Q8_K's values and scale are llama.cpp's: the signed value of largest
    magnitude sets ``iscale = -127 / m`` (values flip sign where m > 0),
    halves round to even, ``d = 1 / iscale``."""
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((4, 512)) * rng.uniform(0.01, 30, (4, 1))).astype(
        np.float32
    )
    x[0, :6] = [-127.0, 2.5, -2.5, 3.5, 0.5, 126.5]  # iscale 1: q = x
    x[1, :5] = [127.0, 2.5, -2.5, 3.5, 0.5]  # iscale -1: q = -x
    x[2, 256:] = 0.0  # a zero block
    xq, dk, _, bs16 = qk._q8_arrays(x, GGMLType.Q4_K)[:4]
    q, d = q8k_reference(x)
    np.testing.assert_array_equal(xq.astype(np.int64), q.reshape(4, 512))
    np.testing.assert_array_equal(dk, d)
    np.testing.assert_array_equal(bs16, q.reshape(4, 32, 16).sum(axis=2))
    assert list(xq[0, :6]) == [-127, 2, -2, 4, 0, 126]
    assert list(xq[1, :5]) == [-127, -2, 2, -4, 0] and dk[1, 0] == -1.0


def k_integers(
    raw: np.ndarray, kind: GGMLType
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A K-quant's blocks as integers: values ``(rows, blocks, 256)`` (Q6_K's
    less its offset of 32), a scale for each value, its min (Q4_K; zeros
    for Q6_K), and d and dmin ``(rows, blocks)``, read from the bytes as
    llama.cpp's dequantize_row_q4_K/q6_K does."""
    size = qk.block_layout(kind)[1]
    blocks = raw.reshape(raw.shape[0], -1, size).astype(np.int64)

    def half(at: int) -> np.ndarray:
        pair = raw.reshape(raw.shape[0], -1, size)[:, :, at : at + 2].copy()
        return pair.view(np.float16)[..., 0].astype(np.float32)

    if kind == GGMLType.Q4_K:
        s = blocks[:, :, 4:16]
        sc = np.concatenate(
            [s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=2
        )
        mn = np.concatenate(
            [s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=2
        )
        qs = blocks[:, :, 16:144].reshape(*blocks.shape[:2], 4, 32)
        q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(*blocks.shape[:2], 256)
        scale = np.repeat(sc, 32, axis=2)
        return q, scale, np.repeat(mn, 32, axis=2), half(0), half(2)
    ql, qh = blocks[:, :, 0:128], blocks[:, :, 128:192]
    parts = []
    for h in range(2):
        low, high = ql[..., 64 * h : 64 * h + 64], qh[..., 32 * h : 32 * h + 32]
        for k in range(4):
            nib = (low[..., 32 * (k % 2) : 32 * (k % 2) + 32] >> (4 * (k // 2))) & 15
            parts.append(nib | (((high >> (2 * k)) & 3) << 4))
    q = np.concatenate(parts, axis=2) - 32
    sc = blocks[:, :, 192:208].astype(np.uint8).view(np.int8).astype(np.int64)
    zero = np.zeros_like(q)
    dmin = np.zeros(blocks.shape[:2], np.float32)
    return q, np.repeat(sc, 16, axis=2), zero, half(208), dmin


def q8k_matmul_reference(
    x: np.ndarray, raw: np.ndarray, kind: GGMLType
) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ggml_vec_dot_q4_K_q8_K/q6_K_q8_K for every token and
    row, in float64: a block's integer sum(scale q_w q_x) times the float32
    ``d_w d_x``, less its integer sum(min q_x) times ``dmin_w d_x``; and a
    float32 rounding bound, 1e-5 of the sum of the products' magnitudes."""
    qx, dx = q8k_reference(x)
    qw, sc, mn, dw, dmin = k_integers(raw, kind)
    dot = np.einsum("tbj,rbj->trb", qx, qw * sc).astype(np.float64)
    mins = np.einsum("tbj,rbj->trb", qx, mn).astype(np.float64)
    d = (dw[None] * dx[:, None]).astype(np.float32).astype(np.float64)
    m = (dmin[None] * dx[:, None]).astype(np.float32).astype(np.float64)
    terms = d * dot - m * mins
    size = np.abs(d) * np.einsum("tbj,rbj->trb", np.abs(qx), np.abs(qw * sc))
    size += np.abs(m) * np.einsum("tbj,rbj->trb", np.abs(qx), mn)
    return terms.sum(axis=2), 1e-5 * size.sum(axis=2) + 1e-30


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_q8k_equals_the_integer_arithmetic(
    kind: GGMLType, threaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if threaded:
        monkeypatch.setattr(kernels, "_threads", 2)
    rng = np.random.default_rng(int(kind))
    for n in (256, 768):
        for rows in (1, 7, 130):  # odd rows: the two-row GEMV's last alone
            raw = random_raw(kind, rows, n, seed=rows + n)
            for t_len in (1, 2, 3, 4, 7, 9):  # GEMVs of 4, 2, 1; panels from 5
                x = rng.standard_normal((t_len, n), dtype=np.float32)
                x[0, :256] = 0.0  # a zero block: d 0, no division
                y = qk.matmul(
                    x, raw, kind, rows, n, threaded=threaded, activations="q8"
                )
                want, bound = q8k_matmul_reference(x, raw, kind)
                assert y.shape == (t_len, rows) and y.dtype == np.float32
                assert np.all(np.abs(y - want) <= bound), (n, rows, t_len)


@pytest.mark.parametrize("kind", sorted(qk.Q8_TYPES | qk.Q8K_TYPES))
def test_q8_token_results_do_not_depend_on_the_batch(kind: GGMLType) -> None:
    """A token's q8 result is the same bits whatever else is in its call:
    below ``_Q8_PANEL_TOKENS`` tokens (GEMVs of 4, 2 and 1 tokens, one and
    two rows a pass) the same as alone; from it (byte panels, 4 tokens and
    1 at a time; the 5 rows past the panel by the GEMVs) the same in any
    such call. The two ways differ in float32 summation order only."""
    rng = np.random.default_rng(3)
    few = qk._Q8_PANEL_TOKENS
    ins = (512,) if kind in qk.Q8K_TYPES else (96, 512)  # 96: an odd block
    for n in ins:
        raw = _random_any(kind, 37, n)  # a 32-row panel and 5 rows
        x = rng.standard_normal((2 * few + 3, n), dtype=np.float32)
        alone = np.concatenate(
            [
                qk.matmul(x[t : t + 1], raw, kind, 37, n, activations="q8")
                for t in range(len(x))
            ]
        )
        for t_len in range(2, few):
            y = qk.matmul(x[:t_len], raw, kind, 37, n, activations="q8")
            np.testing.assert_array_equal(y, alone[:t_len])
        many = qk.matmul(x, raw, kind, 37, n, activations="q8")
        for t_len in (few, few + 1, few + 3):  # other tokens in each four
            y = qk.matmul(x[-t_len:], raw, kind, 37, n, activations="q8")
            np.testing.assert_array_equal(y, many[-t_len:])
        np.testing.assert_array_equal(many[:, 32:], alone[:, 32:])
        scale = np.abs(alone).max()
        np.testing.assert_allclose(many, alone, rtol=0, atol=1e-5 * scale)
        assert not np.array_equal(many[:, :32], alone[:, :32])  # panels ran


def _random_any(kind: GGMLType, rows: int, n: int) -> np.ndarray:
    if kind in qk.Q8K_TYPES:
        return random_raw(kind, rows, n, seed=1)
    w = np.random.default_rng(1).standard_normal((rows, n), dtype=np.float32)
    return qz.quantize(w, kind) if kind in qz.QUANTIZE_TYPES else _q5_1(w)


def _q5_1(w: np.ndarray) -> np.ndarray:
    return np.asarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_1))


@pytest.mark.parametrize("kind", KINDS)
def test_q8k_error_against_float_is_quantization_sized(kind: GGMLType) -> None:
    """Quantized weights from normal floats, activations with an outlier:
    q8's result within 2% of the float product's size, its mean error
    well under that (a few tenths of a percent)."""
    rng = np.random.default_rng(4)
    n = 1536
    w = rng.standard_normal((64, n), dtype=np.float32)
    raw = qz.quantize(w, kind)
    x = rng.standard_normal((3, n), dtype=np.float32)
    x[:, 5] = 8.0
    exact = qk.matmul(x, raw, kind, 64, n)
    y = qk.matmul(x, raw, kind, 64, n, activations="q8")
    scale = np.abs(exact).max()
    assert np.abs(y - exact).max() <= 0.02 * scale
    assert np.abs(y - exact).mean() <= 0.005 * scale


_ISA_SCRIPT = """
import sys
import numpy as np
from structllm.model import quant_kernels as qk
data = np.load(sys.argv[1])
out = {}
for kind in sorted(qk.Q8K_TYPES):
    raw = data[kind.name]
    for t_len in (4, 11):  # GEMVs; byte panels (and the last rows' GEMVs)
        out[f"{kind.name}{t_len}"] = qk.matmul(
            data["x"][:t_len], raw, kind, raw.shape[0], 512, activations="q8"
        )
np.savez(sys.argv[2], **out)
"""


@pytest.mark.exhaustive
@pytest.mark.parametrize("isa", ["avx2", "avx512bw", "generic"])
def test_q8k_dot_products_on_other_instruction_sets(isa: str, tmp_path: Any) -> None:
    """The scaled dot products as AVX2 halves, AVX-512BW and plain LLVM
    arithmetic, whatever this host has: compiled afresh in a process of
    its own."""
    import llvmlite.binding as llvm

    features = llvm.get_host_cpu_features()
    if isa != "generic" and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 only")
    if isa == "avx2" and not features.get("avx2"):
        pytest.skip("no AVX2")
    if isa == "avx512bw" and not features.get("avx512bw"):
        pytest.skip("no AVX-512BW")
    rng = np.random.default_rng(5)
    inputs = {"x": rng.standard_normal((11, 512), dtype=np.float32)}
    for kind in KINDS:
        inputs[kind.name] = random_raw(kind, 37, 512, seed=int(kind))
    np.savez(tmp_path / "in.npz", **inputs)
    env = dict(
        os.environ,
        STRUCTLLM_QK_DOT=isa,
        NUMBA_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=os.pathsep.join(sys.path),
    )
    subprocess.run(
        [sys.executable, "-c", _ISA_SCRIPT, tmp_path / "in.npz", tmp_path / "out.npz"],
        env=env,
        check=True,
    )
    with np.load(tmp_path / "out.npz") as got:
        for kind in KINDS:
            for t_len in (4, 11):
                x = inputs["x"][:t_len]
                want, bound = q8k_matmul_reference(x, inputs[kind.name], kind)
                y = got[f"{kind.name}{t_len}"]
                assert np.all(np.abs(y - want) <= bound), (kind.name, t_len)
