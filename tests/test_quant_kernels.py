"""The quantized CPU matmul kernels against gguf-py's numpy quantizers and
dequantizers (llama.cpp's reference formats)."""

from __future__ import annotations

import numpy as np
import pytest

from structllm.model import kernels
from structllm.model import quant_kernels as qk
from structllm.model.quant_kernels import GGMLType

gguf = pytest.importorskip("gguf")
G = gguf.GGMLQuantizationType

pytestmark = pytest.mark.skipif(not qk.available(), reason="numba is not installed")

#: byte offsets of each block's f16 fields (scales, mins)
_HALVES = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}
_FLOATS = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}
ALL_TYPES = sorted(qk.MATMUL_TYPES)


def random_raw(kind: GGMLType, rows: int, n: int, seed: int = 0) -> np.ndarray:
    """Valid raw rows of ``kind``: random bytes with finite, small scales
    (the types gguf-py cannot quantize, and every bit pattern of the rest)."""
    rng = np.random.default_rng(seed)
    values, size = qk.block_layout(kind)
    if kind in _FLOATS:
        w = rng.standard_normal((rows, n)).astype(_FLOATS[kind])
        return w.view(np.uint8)
    if kind == GGMLType.BF16:
        w = rng.standard_normal((rows, n), dtype=np.float32)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (rows, n // values, size), dtype=np.uint8)
    for at in _HALVES[kind]:
        halves = (rng.standard_normal((rows, n // values)) * 0.01).astype(np.float16)
        raw[:, :, at : at + 2] = halves.view(np.uint8).reshape(rows, n // values, 2)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, kind: GGMLType) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, G(int(kind))), np.float32)


@pytest.mark.parametrize("kind", ALL_TYPES, ids=lambda k: k.name)
def test_dequantize_rows_equals_gguf(kind: GGMLType) -> None:
    n = 512
    raw = random_raw(kind, 9, n, seed=int(kind))
    want = reference(raw, kind)
    np.testing.assert_array_equal(qk.dequantize_rows(raw, kind, n), want)
    out = np.full((4, n), np.nan, np.float32)
    assert qk.dequantize_rows(raw, kind, n, 3, 7, out=out) is out
    np.testing.assert_array_equal(out, want[3:7])


@pytest.mark.parametrize("kind", sorted(qk.QUANTIZE_TYPES), ids=lambda k: k.name)
def test_quantize_equals_gguf(kind: GGMLType) -> None:
    rng = np.random.default_rng(int(kind))
    w = rng.standard_normal((33, 256), dtype=np.float32)
    w[0] = 0.0  # a zero block: scale 0, no division
    w[1, :32] = np.linspace(-1, 1, 32)  # exact halves to round
    raw = qk.quantize(w, kind)
    np.testing.assert_array_equal(raw, gguf.quants.quantize(w, G(int(kind))))
    assert raw.shape == (33, qk.row_bytes(kind, 256))


def _assert_close(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """Within float32 rounding: 1e-5 of |x_t| |w_r| for each element."""
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = 1e-5 * np.outer(np.linalg.norm(x, axis=1), np.linalg.norm(w, axis=1))
    assert np.all(np.abs(y - want) <= bound + 1e-30)


@pytest.mark.parametrize("kind", ALL_TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize("threaded", [False, True])
def test_matmul_matches_dequantized(
    kind: GGMLType, threaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if threaded:  # the threaded kernel whatever the machine
        monkeypatch.setattr(kernels, "_threads", 2)
    values = qk.block_layout(kind)[0]
    rng = np.random.default_rng(int(kind))
    ins = [256, 1280] if values == 256 else [32, 96, 1280]
    for n in ins:
        for rows in (1, 7, 577):
            raw = random_raw(kind, rows, n, seed=rows + n)
            w = reference(raw, kind)
            for t_len in (1, 3, 16, 100):
                x = rng.standard_normal((t_len, n), dtype=np.float32)
                y = qk.matmul(x, raw, kind, rows, n, threaded=threaded)
                assert y.shape == (t_len, rows) and y.dtype == np.float32
                _assert_close(y, x, w)


def test_matmul_writes_out_in_place_and_reads_readonly_weights() -> None:
    raw = random_raw(GGMLType.Q4_K, 10, 512)
    raw.flags.writeable = False  # as a view of a file's mmap
    x = np.random.default_rng(1).standard_normal((5, 512), dtype=np.float32)
    out = np.full((5, 10), np.nan, np.float32)
    assert qk.matmul(x, raw, GGMLType.Q4_K, 10, 512, out=out) is out
    _assert_close(out, x, reference(raw, GGMLType.Q4_K))
    empty = qk.matmul(x[:0], raw, GGMLType.Q4_K, 10, 512)
    assert empty.shape == (0, 10)


def test_layouts_match_gguf() -> None:
    for kind in GGMLType:
        assert qk.block_layout(kind) == gguf.GGML_QUANT_SIZES[G(int(kind))]
        assert kind.name == G(int(kind)).name
    assert qk.row_bytes(GGMLType.Q6_K, 512) == 420
    with pytest.raises(ValueError, match="in_features"):
        qk.row_bytes(GGMLType.Q4_K, 100)
    with pytest.raises(ValueError, match="qtype"):
        qk.block_layout(99)


def test_bad_arguments_raise_value_errors_naming_them() -> None:
    n, rows = 64, 3
    raw = random_raw(GGMLType.Q8_0, rows, n)
    x = np.zeros((2, n), np.float32)
    out = np.zeros((2, rows), np.float32)
    q8 = GGMLType.Q8_0
    cases = [
        ("x", lambda: qk.matmul(x.astype(np.float64), raw, q8, rows, n)),
        ("x", lambda: qk.matmul(x[0], raw, q8, rows, n)),
        ("x", lambda: qk.matmul(np.zeros((n, 2), np.float32).T, raw, q8, rows, n)),
        ("in_features", lambda: qk.matmul(x[:, :32].copy(), raw, q8, rows, n)),
        ("w_raw", lambda: qk.matmul(x, raw.view(np.int8), q8, rows, n)),
        ("w_raw", lambda: qk.matmul(x, raw[:2], q8, rows, n)),
        ("w_raw", lambda: qk.matmul(x, raw, GGMLType.Q4_0, rows, n)),
        ("w_raw", lambda: qk.matmul(x, raw.tolist(), q8, rows, n)),  # type: ignore[arg-type]
        ("w_raw", lambda: qk.matmul(x, np.asfortranarray(raw), q8, rows, n)),
        ("out", lambda: qk.matmul(x, raw, q8, rows, n, out=out[:1])),
        ("out", lambda: qk.matmul(x, raw, q8, rows, n, out=out.astype(np.float64))),
        (
            "out",
            lambda: qk.matmul(x, raw, q8, rows, n, out=np.zeros((3, 2), np.float32).T),
        ),
        ("qtype", lambda: qk.matmul(x, raw, 99, rows, n)),
        ("qtype", lambda: qk.matmul(x, raw, GGMLType.Q2_K, rows, 256)),
        ("in_features", lambda: qk.matmul(x, raw, q8, rows, 48)),
        ("rows", lambda: qk.dequantize_rows(raw, q8, n, 2, 5)),
        ("w", lambda: qk.quantize(np.zeros((2, 32)), q8)),
        ("qtype", lambda: qk.quantize(np.zeros((2, 256), np.float32), GGMLType.Q4_K)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()


def test_warm_up_compiles_without_error() -> None:
    qk.warm_up()


@pytest.mark.parametrize(
    "kind", [GGMLType.F32, GGMLType.F16, GGMLType.BF16], ids=lambda k: k.name
)
def test_one_token_float_rows_of_any_length(kind: GGMLType) -> None:
    """The GEMV takes float rows 32 values a step and the rest one by one."""
    rng = np.random.default_rng(int(kind))
    for n in (1, 31, 37, 101):
        raw = random_raw(kind, 5, n, seed=n)
        x = rng.standard_normal((1, n), dtype=np.float32)
        _assert_close(qk.matmul(x, raw, kind, 5, n), x, reference(raw, kind))
