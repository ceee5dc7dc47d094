"""The quantized CPU matmul kernels against gguf-py's numpy quantizers and
dequantizers (llama.cpp's reference formats)."""

from __future__ import annotations

import platform
from typing import Any

import numpy as np
import pytest

from structllm.model import kernels
from structllm.model import quant_kernels as qk
from structllm.model import quantize as qz
from structllm.model.quant_kernels import GGMLType
from structllm.model.quantized import QuantizedPart

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


@pytest.mark.parametrize(
    # gguf-py has no Q4_K or Q6_K quantizer: tests/test_quantize_q4k.py and
    # tests/test_quantize.py transcribe the C
    "kind",
    sorted(qz.QUANTIZE_TYPES - {GGMLType.Q4_K, GGMLType.Q6_K}),
    ids=lambda k: k.name,
)
def test_quantize_equals_gguf(kind: GGMLType) -> None:
    rng = np.random.default_rng(int(kind))
    w = rng.standard_normal((33, 256), dtype=np.float32)
    w[0] = 0.0  # a zero block: scale 0, no division
    w[1, :32] = np.linspace(-1, 1, 32)  # exact halves to round
    raw = qz.quantize(w, kind)
    np.testing.assert_array_equal(raw, gguf.quants.quantize(w, G(int(kind))))
    assert raw.shape == (33, qk.row_bytes(kind, 256))


def _assert_close(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """Within float32 rounding: 1e-5 of |x_t| |w_r| for each element."""
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = 1e-5 * np.outer(np.linalg.norm(x, axis=1), np.linalg.norm(w, axis=1))
    assert np.all(np.abs(y - want) <= bound + 1e-30)


#: the long matrices (compiling every type's threaded and q8 kernels, other
#: instruction sets in fresh processes) run in ``nox -s exhaustive``; the
#: default suite keeps every type serial and a few threaded
EXHAUSTIVE = pytest.mark.exhaustive


def _cases(
    kinds: Any, keep_threaded: set[GGMLType], keep: set[GGMLType] | None = None
) -> list[Any]:
    out = []
    for kind in kinds:
        for threaded in (False, True):
            default = (keep is None or kind in keep) and (
                not threaded or kind in keep_threaded
            )
            marks = () if default else (EXHAUSTIVE,)
            out.append(
                pytest.param(kind, threaded, marks=marks, id=f"{threaded}-{kind.name}")
            )
    return out


@pytest.mark.parametrize(
    ("kind", "threaded"),
    _cases(ALL_TYPES, {GGMLType.Q8_0, GGMLType.Q4_1, GGMLType.Q4_K}),
)
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
            for t_len in (1, 2, 3, 4, 7, 16, 100):
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


def test_writable_weights_run_the_kernels_compiled_for_read_only_ones() -> None:
    """One compile a kernel, not one for writable weights and one for a
    file's read-only map (30-40 s each on a cold cache)."""
    raw = random_raw(GGMLType.Q8_0, 10, 64)
    x = np.random.default_rng(2).standard_normal((3, 64), dtype=np.float32)
    y = qk.matmul(x, raw, GGMLType.Q8_0, 10, 64)
    _assert_close(y, x, reference(raw, GGMLType.Q8_0))
    qk.matmul(x, raw, GGMLType.Q8_0, 10, 64, activations="q8")
    qk.dequantize_rows(raw, GGMLType.Q8_0, 64, 2, 5)
    assert raw.flags.writeable  # the caller's array is left as it was
    # the weight is the second argument of the products, the first of
    # dequantize_rows
    for kernel, at in (
        (qk._matmul_rows, 1),
        (qk._matmul8, 1),
        (qk._dequantize_rows, 0),
    ):
        weights = [sig[at] for sig in kernel.signatures]
        assert weights and not any(w.mutable for w in weights), kernel
    part = QuantizedPart(raw, GGMLType.Q8_0)
    assert not part.raw.flags.writeable and np.shares_memory(part.raw, raw)


def test_layouts_match_gguf() -> None:
    for kind in qk.MATMUL_TYPES:
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
        ("w", lambda: qz.quantize(np.zeros((2, 32)), q8)),
        ("qtype", lambda: qz.quantize(np.zeros((2, 256), np.float32), GGMLType.Q5_K)),
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


def test_buffered_kernel_inputs_of_any_length_and_chunks() -> None:
    """Past 8 tokens the buffered kernel runs: its vector micro-kernel where
    a chunk's inputs are a multiple of 16, the scalar one elsewhere (float
    rows of any length), over two chunks of 1024 inputs and a last quad of
    fewer than 4 rows."""
    rng = np.random.default_rng(5)
    for kind, n in [
        (GGMLType.F32, 37),
        (GGMLType.F16, 1040),
        (GGMLType.F32, 1043),
        (GGMLType.Q6_K, 1280),
        (GGMLType.Q5_0, 1056),
    ]:
        raw = random_raw(kind, 6, n, seed=n)
        x = rng.standard_normal((13, n), dtype=np.float32)
        _assert_close(qk.matmul(x, raw, kind, 6, n), x, reference(raw, kind))


@pytest.mark.parametrize("threaded", [False, True])
def test_a_tokens_bits_do_not_depend_on_the_other_tokens_of_its_kernel(
    threaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From ``_OUTER_TOKENS`` tokens a call, whole 32-row panels take the
    outer-product kernel, each output one lane's sum in input order: a
    token's row is the same bits in any call of that many tokens (150
    against 32 at a time, and 40 with partial tiles). The last rows, fewer
    than 32, take the 4x4 micro-kernel, whose 128-row panels past
    ``_TILE_FLOATS`` sum in the order a quad at a time does: the same bits
    as in a call of a few tokens. Both are the few tokens' product to
    float32 rounding."""
    if threaded:
        monkeypatch.setattr(kernels, "_threads", 2)
    rng = np.random.default_rng(9)
    whole = 32 * (301 // 32)
    for kind, n in [(GGMLType.Q8_0, 576), (GGMLType.Q4_1, 1056), (GGMLType.Q6_K, 1280)]:
        raw = random_raw(kind, 301, n, seed=n)
        x = rng.standard_normal((150, n), dtype=np.float32)
        assert x.shape[0] * min(n, qk._CHUNK) > qk._TILE_FLOATS
        y = qk.matmul(x, raw, kind, 301, n, threaded=threaded)
        for s, e in [(0, 32), (32, 64), (64, 96), (96, 128), (110, 150)]:
            assert e - s >= qk._OUTER_TOKENS
            part = qk.matmul(x[s:e], raw, kind, 301, n, threaded=threaded)
            np.testing.assert_array_equal(y[s:e], part)
        for s in range(0, 150, 8):
            part = qk.matmul(x[s : s + 8], raw, kind, 301, n, threaded=threaded)
            np.testing.assert_array_equal(y[s : s + 8, whole:], part[:, whole:])
            scale = np.abs(part).max()
            np.testing.assert_allclose(
                y[s : s + 8, :whole], part[:, :whole], rtol=0, atol=1e-5 * scale
            )


# -- q8 activations: llama.cpp's integer dot products ---------------------------


def q8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's ``quantize_row_q8_1`` on x86 (q8_0's values and d, and
    s; its AVX code, not the C reference: ``x * (127 / max |x|)`` rounded
    half to even, where the reference takes ``roundf(x / d)``): ``q`` int64
    ``(T, blocks, 32)``, ``d`` and ``s`` float32 ``(T, blocks)``."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax == 0, np.float32(0), np.float32(127) / amax)
    q = np.rint(blocks * inverse.astype(np.float32)[..., None]).astype(np.int64)
    s = (q.sum(axis=2).astype(np.float32) * d).astype(np.float16).astype(np.float32)
    return q, d.astype(np.float16).astype(np.float32), s


def test_q8_blocks_round_as_llama_cpp_on_x86() -> None:
    """The activations' Q8_0/Q8_1 values and scales are llama-server's own:
    halves round to even (2.5 -> 2, where the C reference's ``roundf`` gives
    3) and the multiplier is ``127 / max``, not ``1 / (max / 127)``."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((6, 96)) * rng.uniform(0.01, 30, (6, 1))).astype(
        np.float32
    )
    x[0, :8] = [127.0, 2.5, -2.5, 3.5, 0.5, -0.5, 1.5, -126.5]  # multiplier 1
    x[1, 32:64] = 0.0  # a zero block
    xq, dx = qk._q8_arrays(x, GGMLType.Q8_0)[:2]
    q, d, _ = q8_reference(x)
    np.testing.assert_array_equal(xq[:, :96].astype(np.int64), q.reshape(6, 96))
    np.testing.assert_array_equal(dx[:, : 8 * 3 : 8], d)
    assert list(xq[0, :8]) == [127, 2, -2, 4, 0, 0, 2, -126]


def weight_integers(
    raw: np.ndarray, kind: GGMLType
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A 32-value type's blocks as llama.cpp's dot products read them:
    integers ``(rows, blocks, 32)`` (the offset of Q4_0/Q5_0 taken off), d
    and m (None for the types without one) ``(rows, blocks)``."""
    size = qk.block_layout(kind)[1]
    blocks = raw.reshape(raw.shape[0], -1, size)

    def half(at: int) -> np.ndarray:
        pair = blocks[:, :, at : at + 2].copy().view(np.float16)
        return pair[..., 0].astype(np.float32)

    def nibbles(at: int) -> np.ndarray:
        q = blocks[:, :, at : at + 16].astype(np.int64)
        return np.concatenate([q & 15, q >> 4], axis=2)

    def fifth(at: int) -> np.ndarray:
        qh = blocks[:, :, at : at + 4].copy().view("<u4")[..., 0].astype(np.int64)
        return ((qh[..., None] >> np.arange(32)) & 1) << 4

    if kind == GGMLType.Q8_0:
        return blocks[:, :, 2:].view(np.int8).astype(np.int64), half(0), None
    if kind == GGMLType.Q4_0:
        return nibbles(2) - 8, half(0), None
    if kind == GGMLType.Q4_1:
        return nibbles(4), half(0), half(2)
    if kind == GGMLType.Q5_0:
        return (nibbles(6) | fifth(2)) - 16, half(0), None
    return nibbles(8) | fifth(4), half(0), half(2)  # Q5_1


def q8_matmul_reference(
    x: np.ndarray, raw: np.ndarray, kind: GGMLType
) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``ggml_vec_dot_*_q8_0``/``q8_1`` (generic versions) for
    every token and row, in float64: a block's integer dot times the float32
    ``d_w * d_x`` (plus ``m_w * s_x``), summed over blocks; and a float32
    rounding bound, 1e-5 of the sum of the terms' magnitudes."""
    qx, dx, sx = q8_reference(x)
    qw, dw, mw = weight_integers(raw, kind)
    dot = np.einsum("tbj,rbj->trb", qx, qw).astype(np.float64)
    size = np.einsum("tbj,rbj->trb", np.abs(qx), np.abs(qw)).astype(np.float64)
    scale = (dw[None] * dx[:, None]).astype(np.float32).astype(np.float64)
    terms, size = scale * dot, np.abs(scale) * size
    if mw is not None:
        mins = mw[None].astype(np.float64) * sx[:, None].astype(np.float64)
        terms, size = terms + mins, size + np.abs(mins)
    return terms.sum(axis=2), 1e-5 * size.sum(axis=2) + 1e-30


@pytest.mark.parametrize(
    ("kind", "threaded"),
    _cases(
        sorted(qk.Q8_TYPES),
        {GGMLType.Q4_1},
        keep={GGMLType.Q8_0, GGMLType.Q4_1},
    ),
)
def test_q8_activations_equal_llama_cpp_arithmetic(
    kind: GGMLType, threaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if threaded:
        monkeypatch.setattr(kernels, "_threads", 2)
    rng = np.random.default_rng(int(kind))
    for n in (32, 96, 576):  # odd block counts pair the last block with zeros
        for rows in (1, 7, 577):
            raw = random_raw(kind, rows, n, seed=rows + n)
            for t_len in (1, 2, 3, 4, 7, 16):  # GEMVs of 4, 2 and 1 tokens
                x = rng.standard_normal((t_len, n), dtype=np.float32)
                x[0, :32] = 0.0  # a zero block: d 0, no division
                y = qk.matmul(
                    x, raw, kind, rows, n, threaded=threaded, activations="q8"
                )
                want, bound = q8_matmul_reference(x, raw, kind)
                assert y.shape == (t_len, rows) and y.dtype == np.float32
                assert np.all(np.abs(y - want) <= bound), (n, rows, t_len)


def test_q8_activations_leave_other_types_float() -> None:
    raw = random_raw(GGMLType.Q5_K, 9, 512)  # no Q8_K kernel (Q4_K, Q6_K have)
    x = np.random.default_rng(2).standard_normal((3, 512), dtype=np.float32)
    y = qk.matmul(x, raw, GGMLType.Q5_K, 9, 512, activations="q8")
    np.testing.assert_array_equal(y, qk.matmul(x, raw, GGMLType.Q5_K, 9, 512))
    with pytest.raises(ValueError, match="activations"):
        qk.matmul(x, raw, GGMLType.Q5_K, 9, 512, activations="int8")


_ISA_SCRIPT = """
import sys
import numpy as np
from structllm.model import quant_kernels as qk
from structllm.model import quantize as qz
data = np.load(sys.argv[1])
out = {}
for kind in sorted(qk.Q8_TYPES):
    raw = data[kind.name]
    for t_len in (4, 11):  # GEMVs; byte panels (and the last rows' GEMVs)
        x = data["x"][:t_len]
        out[f"{kind.name}{t_len}"] = qk.matmul(
            x, raw, kind, raw.shape[0], 96, activations="q8"
        )
np.savez(sys.argv[2], **out)
"""


@EXHAUSTIVE
@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_q8_dot_products_on_other_instruction_sets(
    isa: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dot product as AVX2 (two ``vpmaddubsw`` halves) and as plain LLVM
    arithmetic (any CPU), whatever this host has: compiled afresh in a
    process of its own."""
    import os
    import subprocess
    import sys

    if isa == "avx2" and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 only")
    if isa == "avx2" and not _has_avx2():
        pytest.skip("no AVX2")
    rng = np.random.default_rng(5)
    inputs = {"x": rng.standard_normal((11, 96), dtype=np.float32)}
    for kind in sorted(qk.Q8_TYPES):
        inputs[kind.name] = random_raw(kind, 37, 96, seed=int(kind))
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
        for kind in sorted(qk.Q8_TYPES):
            for t_len in (4, 11):
                x = inputs["x"][:t_len]
                want, bound = q8_matmul_reference(x, inputs[kind.name], kind)
                y = got[f"{kind.name}{t_len}"]
                assert np.all(np.abs(y - want) <= bound), (kind.name, t_len)


def _has_avx2() -> bool:
    import llvmlite.binding as llvm

    return bool(llvm.get_host_cpu_features().get("avx2"))


def test_checks_remembered_for_a_weight_still_catch_changes() -> None:
    """A weight's checks are remembered by its array object (a decode step
    calls matmul ~121 times): a different shape, type or view of it is
    checked afresh, and the entry leaves with the array."""
    import gc

    raw = random_raw(GGMLType.Q8_0, 6, 64)
    x = np.zeros((1, 64), np.float32)
    qk.matmul(x, raw, GGMLType.Q8_0, 6, 64)
    qk.matmul(x, raw, GGMLType.Q8_0, 6, 64)  # remembered
    with pytest.raises(ValueError, match="w_raw"):
        qk.matmul(x, raw, GGMLType.Q8_0, 5, 64)
    with pytest.raises(ValueError, match="w_raw"):
        qk.matmul(x, raw, GGMLType.Q4_0, 6, 64)
    with pytest.raises(ValueError, match="w_raw"):
        qk.matmul(x, raw.view(np.int8), GGMLType.Q8_0, 6, 64)
    raw.shape = (3, 136)  # the same object, reshaped in place
    with pytest.raises(ValueError, match="w_raw"):
        qk.matmul(x, raw, GGMLType.Q8_0, 6, 64)
    other = random_raw(GGMLType.Q8_0, 2, 32)
    qk.matmul(np.zeros((1, 32), np.float32), other, GGMLType.Q8_0, 2, 32)
    key = (id(other), GGMLType.Q8_0, 2, 32)
    assert key in qk._CHECKED
    del other
    gc.collect()
    assert key not in qk._CHECKED
