"""The GGUF reader and the GGML dequantizers (structllm.formats).

Three oracles:

- ``tests/ggml_reference.py``: llama.cpp's C ``dequantize_row_*`` loops
  transcribed with float32 scalars; no dependency.
- the ``gguf`` package (llama.cpp's gguf-py, a test-only dependency):
  its ``GGUFWriter`` writes the files, its ``GGUFReader`` and
  ``gguf.quants.dequantize`` read them back. Tests that need it skip without
  it.
- the real SmolLM2-135M Q4_1 file (the built-in ``smollm2``, fetched once
  through pip; marked ``real``).

Every comparison of values is bit-exact (``uint32`` views): both oracles and
our code compute ``d * q`` and ``(d * sc) * q - dmin * m`` in float32 in
the same order, so there is no rounding to allow for. Only blocks with NaN or
infinite scales are compared as "equal, NaN equal to any NaN" (a NaN's
payload depends on operand order).
"""

from __future__ import annotations

import math
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from structllm.errors import ModelLoadError
from structllm.formats import (
    DEQUANTIZABLE,
    GGMLType,
    GGUFFile,
    GGUFTensor,
    GGUFValueType,
    block_layout,
    dequantize,
    tensor_nbytes,
)
from structllm.models import SMOLLM2, resolve_model
from tests import gguf_bytes as gb
from tests.ggml_reference import dequantize_blocks as reference_dequantize

REQUIRED = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
EXTRA = ["F64", "Q5_0", "Q5_1", "Q2_K", "Q3_K"]
ALL_SUPPORTED = REQUIRED + EXTRA
# the types gguf-py can quantize (its K-quants only dequantize)
GGUF_PY_QUANTIZES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_bit_equal(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == np.float32
    assert ours.shape == theirs.shape
    mismatch = np.flatnonzero(bits(ours) != bits(theirs))
    assert mismatch.size == 0, (
        f"{mismatch.size} values differ, first at flat index {mismatch[0]}: "
        f"{ours.reshape(-1)[mismatch[0]]!r} != {theirs.reshape(-1)[mismatch[0]]!r}"
    )


def write(tmp_path: Path, data: bytes, name: str = "model.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def open_fails(path: Path, *fragments: str) -> ModelLoadError:
    """GGUFFile.open(path) raises ModelLoadError naming the file and fragments."""
    with pytest.raises(ModelLoadError) as info:
        GGUFFile.open(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return info.value


@pytest.fixture(scope="module")
def gguf() -> Any:
    return pytest.importorskip("gguf")


# -- block formats ----------------------------------------------------------------


def test_block_layouts() -> None:
    assert block_layout(GGMLType.F32) == (1, 4)
    assert block_layout(GGMLType.BF16) == (1, 2)
    assert block_layout(GGMLType.Q8_0) == (32, 34)
    assert block_layout(GGMLType.Q4_0) == (32, 18)
    assert block_layout(GGMLType.Q4_1) == (32, 20)
    assert block_layout(GGMLType.Q4_K) == (256, 144)
    assert block_layout(GGMLType.Q5_K) == (256, 176)
    assert block_layout(GGMLType.Q6_K) == (256, 210)
    assert block_layout(12) == (256, 144)
    assert tensor_nbytes(GGMLType.Q4_1, (576, 1536)) == 576 * 1536 // 32 * 20
    assert tensor_nbytes(GGMLType.F32, ()) == 4
    with pytest.raises(ValueError, match="whole number"):
        tensor_nbytes(GGMLType.Q4_0, (2, 33))
    with pytest.raises(ValueError):
        block_layout(4)  # Q4_2, removed from ggml
    assert {t.name for t in DEQUANTIZABLE} == set(ALL_SUPPORTED)


def test_types_and_layouts_match_gguf_py(gguf: Any) -> None:
    """Every type we know has gguf-py's number and layout (gguf-py 0.19 knows
    exactly ours; a later one may know more, which we then refuse by number)."""
    theirs = {t.name: int(t) for t in gguf.GGMLQuantizationType}
    assert {t.name: int(t) for t in GGMLType}.items() <= theirs.items()
    for t in GGMLType:
        assert block_layout(t) == tuple(
            gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))]
        )


@pytest.mark.parametrize("type_name", ALL_SUPPORTED)
def test_dequantize_matches_the_c_reference(type_name: str) -> None:
    kind = GGMLType[type_name]
    per_block, block_bytes = block_layout(kind)
    rng = np.random.default_rng(7)
    n_blocks = 6
    blocks = gb.random_blocks(rng, type_name, n_blocks, block_bytes)
    shape = (2, n_blocks // 2 * per_block)
    ours = dequantize(blocks.reshape(-1), kind, shape)
    expected = reference_dequantize(type_name, blocks).reshape(shape)
    assert_bit_equal(ours, expected)


def test_q4_k_scale_packing_by_hand() -> None:
    """Sub-blocks 4-7 of Q4_K take 4 bits from bytes 8-11, 2 from bytes 0-7."""
    block = bytearray(144)
    block[0:2] = np.float16(1.0).tobytes()  # d
    block[2:4] = np.float16(0.5).tobytes()  # dmin
    scales = bytearray(12)
    scales[0] = 0b11_000011  # sc0 = 3, top bits of sc4 = 3
    scales[4] = 0b01_000101  # m0 = 5, top bits of m4 = 1
    scales[8] = 0b0010_0111  # sc4 low = 7, m4 low = 2
    block[4:16] = scales
    block[16:144] = bytes([0x21] * 128)  # low nibble 1, high nibble 2
    out = dequantize(np.frombuffer(bytes(block), np.uint8), GGMLType.Q4_K, (256,))
    assert out[0] == 3 * 1 - 0.5 * 5  # sub-block 0: sc 3, m 5, q 1
    assert out[32] == 0.0  # sub-block 1: sc 0, m 0
    sc4, m4 = 7 | (3 << 4), 2 | (1 << 4)
    assert out[128] == sc4 * 1 - 0.5 * m4  # sub-block 4, low nibbles
    assert out[160] == 0.0  # sub-block 5


@pytest.mark.parametrize("type_name", [t for t in ALL_SUPPORTED if t != "F64"])
def test_dequantize_matches_gguf_py(gguf: Any, type_name: str) -> None:
    """Random blocks (finite scales): bit-identical to gguf.quants.dequantize."""
    kind = GGMLType[type_name]
    per_block, block_bytes = block_layout(kind)
    rng = np.random.default_rng(int(kind))
    rows, blocks_per_row = 37, 5  # several chunks' worth for the 32-value types
    blocks = gb.random_blocks(rng, type_name, rows * blocks_per_row, block_bytes)
    raw = blocks.reshape(rows, blocks_per_row * block_bytes)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(kind)))
    ours = dequantize(raw, kind, (rows, blocks_per_row * per_block))
    assert_bit_equal(ours, np.asarray(theirs, dtype=np.float32))


@pytest.mark.parametrize("type_name", [t for t in ALL_SUPPORTED if t != "F64"])
def test_dequantize_any_bytes_matches_gguf_py(gguf: Any, type_name: str) -> None:
    """Arbitrary bytes, NaN and infinite scales included: no warning, same values."""
    kind = GGMLType[type_name]
    per_block, block_bytes = block_layout(kind)
    rng = np.random.default_rng(100 + int(kind))
    raw = rng.integers(0, 256, size=(64, 4 * block_bytes), dtype=np.uint8)
    raw[:4, : 4 * block_bytes] = 0xFF  # NaN scales for sure
    raw[4:8, : 4 * block_bytes] = 0x7C  # 0x7c7c: a NaN f16; 0x7c00 would be inf
    with np.errstate(all="ignore"):
        theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(kind)))
    ours = dequantize(raw, kind, (64, 4 * per_block))
    np.testing.assert_array_equal(ours, theirs)  # NaN == NaN here


@pytest.mark.parametrize("type_name", GGUF_PY_QUANTIZES)
def test_quantized_floats_round_trip_through_a_file(
    gguf: Any, tmp_path: Path, type_name: str
) -> None:
    """gguf-py quantizes random floats, GGUFWriter writes them, we read them."""
    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(3)
    data = (rng.standard_normal((48, 96)) * 0.02).astype(np.float32)
    quantized = gguf.quants.quantize(data, qtype)
    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    if type_name in ("F32", "F16"):
        writer.add_tensor("w", quantized)
    else:
        writer.add_tensor("w", quantized, raw_dtype=qtype)
    write_out(writer)
    with GGUFFile.open(path) as f:
        t = f.tensors["w"]
        assert (t.type, t.shape) == (GGMLType[type_name], (48, 96))
        assert f.raw("w").tobytes() == quantized.tobytes()
        ours = f.dequantize("w")
    theirs = gguf.quants.dequantize(quantized.view(np.uint8).reshape(48, -1), qtype)
    assert_bit_equal(ours, np.asarray(theirs, dtype=np.float32).reshape(48, 96))
    # and the values are the floats, to the format's precision
    step = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1 / 127}.get(type_name, 1 / 7)
    scale = np.abs(data).max()
    assert np.abs(ours - data).max() <= step * scale + 1e-7


def write_out(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_dequantize_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ModelLoadError, match="IQ2_XXS"):
        dequantize(np.zeros(66, np.uint8), GGMLType.IQ2_XXS, (256,))
    with pytest.raises(ValueError, match="needs 68 bytes"):
        dequantize(np.zeros(34, np.uint8), GGMLType.Q8_0, (2, 32))
    with pytest.raises(ValueError, match="whole number"):
        dequantize(np.zeros(34, np.uint8), GGMLType.Q8_0, (2, 16))


def test_dequantize_returns_a_new_writable_array(tmp_path: Path) -> None:
    built = gb.sample_file()
    with GGUFFile.open(write(tmp_path, built.data)) as f:
        for name in f.tensors:
            out = f.dequantize(name)
            assert out.flags.writeable and out.flags.c_contiguous
            assert not np.shares_memory(out, f.raw(name))
            assert out.dtype == np.float32
            assert out.shape == f.tensors[name].shape


# -- metadata and tensor infos ------------------------------------------------------

EVERY_SCALAR = [
    ("u8", gb.UINT8, 255),
    ("i8", gb.INT8, -128),
    ("u16", gb.UINT16, 65535),
    ("i16", gb.INT16, -32768),
    ("u32", gb.UINT32, 2**32 - 1),
    ("i32", gb.INT32, -(2**31)),
    ("f32", gb.FLOAT32, 0.1),
    ("bool", gb.BOOL, True),
    ("str", gb.STRING, "héllo ✓ \x00 end"),
    ("empty", gb.STRING, ""),
    ("u64", gb.UINT64, 2**64 - 1),
    ("i64", gb.INT64, -(2**63)),
    ("f64", gb.FLOAT64, 0.1),
]


def test_metadata_of_every_type(tmp_path: Path) -> None:
    kvs = [gb.kv(key, vtype, value) for key, vtype, value in EVERY_SCALAR]
    kvs += [
        gb.kv("a.u8", gb.ARRAY, (gb.UINT8, [0, 255])),
        gb.kv("a.i16", gb.ARRAY, (gb.INT16, [-1, 2])),
        gb.kv("a.u64", gb.ARRAY, (gb.UINT64, [2**64 - 1])),
        gb.kv("a.f32", gb.ARRAY, (gb.FLOAT32, [0.5, -1.25])),
        gb.kv("a.f64", gb.ARRAY, (gb.FLOAT64, [1e300])),
        gb.kv("a.bool", gb.ARRAY, (gb.BOOL, [True, False, True])),
        gb.kv("a.str", gb.ARRAY, (gb.STRING, ["a", "", "ü"])),
        gb.kv("a.empty", gb.ARRAY, (gb.INT32, [])),
        gb.kv("a.empty_str", gb.ARRAY, (gb.STRING, [])),
        gb.kv(
            "a.nested",
            gb.ARRAY,
            (
                gb.ARRAY,
                [
                    (gb.INT32, [1, 2]),
                    (gb.STRING, ["x"]),
                    (gb.ARRAY, [(gb.BOOL, [False])]),
                ],
            ),
        ),
    ]
    with GGUFFile.open(write(tmp_path, gb.build(kvs).data)) as f:
        md = f.metadata
        assert f.version == 3 and f.tensors == {}
        assert list(md) == [k for k, _, _ in EVERY_SCALAR] + [
            "a.u8", "a.i16", "a.u64", "a.f32", "a.f64", "a.bool", "a.str",
            "a.empty", "a.empty_str", "a.nested",
        ]  # fmt: skip
        for key, vtype, value in EVERY_SCALAR:
            expected = float(np.float32(value)) if vtype == gb.FLOAT32 else value
            assert md[key] == expected and type(md[key]) is type(expected), key
            assert f.value_types[key] == GGUFValueType(vtype)
        for key, dtype, values in [
            ("a.u8", np.uint8, [0, 255]),
            ("a.i16", np.int16, [-1, 2]),
            ("a.u64", np.uint64, [2**64 - 1]),
            ("a.f32", np.float32, [0.5, -1.25]),
            ("a.f64", np.float64, [1e300]),
            ("a.empty", np.int32, []),
        ]:
            assert isinstance(md[key], np.ndarray) and md[key].dtype == dtype, key
            assert md[key].dtype.isnative and md[key].flags.writeable
            assert md[key].tolist() == values
            # the same numbers read without numpy, Python's own
            as_list = md.as_list(key)
            assert as_list == values and type(as_list) is list, key
            assert all(
                type(v) is type(w) for v, w in zip(as_list, values, strict=True)
            ), key
        assert md["a.bool"] == [True, False, True]
        assert md["a.str"] == ["a", "", "ü"] and md["a.empty_str"] == []
        nested = md["a.nested"]
        assert (
            nested[0].tolist() == [1, 2]
            and nested[1] == ["x"]
            and nested[2] == [[False]]
        )
        assert md.as_list("a.nested") == [[1, 2], ["x"], [[False]]]
        assert md.as_list("a.str") == ["a", "", "ü"] and md.as_list("nope") is None
        assert f.value_types["a.nested"] is GGUFValueType.ARRAY


def test_arrays_are_checked_at_open_and_read_when_looked_up(tmp_path: Path) -> None:
    """A tokenizer's arrays are most of a file's metadata: opening the file
    checks them and keeps none of them; each lookup reads a new copy."""
    tokens = [f"tok{i}" for i in range(50_000)]
    kvs = [
        gb.kv("general.architecture", gb.STRING, "llama"),
        gb.kv("tokenizer.ggml.tokens", gb.ARRAY, (gb.STRING, tokens)),
        gb.kv("tokenizer.ggml.token_type", gb.ARRAY, (gb.INT32, [1] * 50_000)),
        gb.kv("n", gb.UINT32, 7),
    ]
    path = write(tmp_path, gb.build(kvs).data)
    tracemalloc.start()
    try:
        f = GGUFFile.open(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # the strings alone take 3 MiB
    with f:
        md = f.metadata
        assert list(md) == [
            "general.architecture",
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.token_type",
            "n",
        ]
        assert "n" in md and "absent" not in md and len(md) == 4
        assert md.array_length("tokenizer.ggml.tokens") == 50_000
        assert md.array_length("n") is None and md.array_length("absent") is None
        first = md["tokenizer.ggml.tokens"]
        assert first == tokens
        first[0] = "changed"  # the caller's own copy
        assert md["tokenizer.ggml.tokens"][0] == "tok0"
        types = md["tokenizer.ggml.token_type"]
        assert types.dtype == np.int32 and types.flags.writeable
        assert not np.shares_memory(types, md["tokenizer.ggml.token_type"])
    # closed, the file is unmapped; as load_tokenizer reads it, a lookup
    # maps it again for the read
    assert f.closed and not _mapped(path)
    assert md["tokenizer.ggml.tokens"][-1] == "tok49999" and md["n"] == 7
    assert not _mapped(path)
    with path.open("ab") as out:
        out.write(b"more")
    with pytest.raises(ModelLoadError, match=r"changed size .* 'tokenizer\.ggml"):
        md["tokenizer.ggml.tokens"]
    path.unlink()
    with pytest.raises(ModelLoadError, match=r"cannot reopen GGUF file"):
        md["tokenizer.ggml.tokens"]


def _mapped(path: Path) -> bool:
    """Whether this process maps ``path`` (False where /proc cannot tell)."""
    maps = Path("/proc/self/maps")
    return maps.exists() and str(path) in maps.read_text()


def _resident_kib(path: Path) -> int:
    """This process's resident KiB of its mappings of ``path`` (smaps)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:
            ours = head[-1] == str(path)
        elif ours and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's smaps")
def test_the_header_pages_leave_resident_memory_once_read(tmp_path: Path) -> None:
    """A quantized model keeps its file mapped for good: the header's pages
    (the tokenizer's arrays, 1.7 MiB for SmolLM2) do not stay resident."""
    tokens = [f"token{i:07d}" for i in range(200_000)]  # 4 MiB
    kvs = [gb.kv("tokenizer.ggml.tokens", gb.ARRAY, (gb.STRING, tokens))]
    path = write(tmp_path, gb.build(kvs).data)
    with GGUFFile.open(path) as f:
        assert _resident_kib(path) <= 8
        assert f.metadata["tokenizer.ggml.tokens"] == tokens
        assert _resident_kib(path) <= 8


def test_tensor_infos(tmp_path: Path) -> None:
    built = gb.sample_file()
    with GGUFFile.open(write(tmp_path, built.data)) as f:
        assert list(f.tensors) == ["norm.weight", "half", "q4", "q8", "q4k", "q6k"]
        q4 = f.tensors["q4"]
        assert q4 == GGUFTensor(
            "q4", GGMLType.Q4_0, (2, 64), built.tensor_offsets["q4"], 72
        )
        assert f.tensors["half"].shape == (3, 4)  # ne = [4, 3]
        assert f.tensors["q6k"].shape == (256,)
        assert f.tensors["q4k"].n_elements == 512
        assert f.data_offset == built.data_start and f.alignment == 32
        for t in f.tensors.values():
            assert f.raw(t.name).tobytes() == built.data[t.offset : t.offset + t.nbytes]
        assert f.metadata["tokenizer.ggml.tokens"] == ["<s>", "a", "bé", "ĠĠ"]


def test_raw_is_a_read_only_view_of_the_map(tmp_path: Path) -> None:
    with GGUFFile.open(write(tmp_path, gb.sample_file().data)) as f:
        a, b = f.raw("q8"), f.raw("q8")
        assert a.dtype == np.uint8 and a.shape == (3 * 34,)
        assert np.shares_memory(a, b) and not a.flags.writeable
        assert not a.flags.owndata


def test_zero_dimension_and_empty_tensors(tmp_path: Path) -> None:
    tensors = [
        gb.Tensor("scalar", [], 0, np.float32(2.5).tobytes()),
        gb.Tensor("empty", [32, 0], 8, b""),
        gb.Tensor("after", [2], 1, np.array([1, -2], "<f2").tobytes()),
    ]
    with GGUFFile.open(write(tmp_path, gb.build([], tensors).data)) as f:
        assert f.tensors["scalar"].shape == ()
        assert f.dequantize("scalar").shape == () and f.dequantize("scalar") == 2.5
        assert f.dequantize("empty").shape == (0, 32)
        assert f.dequantize("after").tolist() == [1.0, -2.0]


def test_custom_alignment_and_version_2(tmp_path: Path) -> None:
    tensors = [
        gb.Tensor("a", [3], 0, np.arange(3, dtype="<f4").tobytes()),
        gb.Tensor("b", [2], 0, np.ones(2, "<f4").tobytes()),
    ]
    kvs = [gb.kv("general.alignment", gb.UINT32, 256)]
    built = gb.build(kvs, tensors, alignment=256, version=2)
    with GGUFFile.open(write(tmp_path, built.data)) as f:
        assert f.version == 2 and f.alignment == 256
        assert (
            f.tensors["b"].offset % 256 == 0
            and f.tensors["b"].offset == built.tensor_offsets["b"]
        )
        assert f.dequantize("b").tolist() == [1.0, 1.0]


def test_unsupported_type_opens_and_refuses_to_dequantize(tmp_path: Path) -> None:
    tensors = [
        gb.Tensor("iq", [256], int(GGMLType.IQ2_XXS), bytes(66)),
        gb.Tensor("ints", [4], int(GGMLType.I32), bytes(16)),
    ]
    path = write(tmp_path, gb.build([], tensors).data)
    with GGUFFile.open(path) as f:
        assert f.raw("iq").size == 66
        for name, kind in [("iq", "IQ2_XXS"), ("ints", "I32")]:
            with pytest.raises(ModelLoadError) as info:
                f.dequantize(name)
            assert str(path) in str(info.value)
            assert repr(name) in str(info.value) and kind in str(info.value)
        with pytest.raises(ModelLoadError, match="no tensor 'nope'"):
            f.raw("nope")


def test_close(tmp_path: Path) -> None:
    built = gb.sample_file()
    path = write(tmp_path, built.data)
    with GGUFFile.open(path) as f:
        kept = f.raw("q4")
        assert not f.closed
    assert f.closed
    with pytest.raises(ValueError, match="closed"):
        f.raw("q4")
    with pytest.raises(ValueError, match="closed"):
        f.dequantize("q4")
    # a view taken before close still reads the file
    t = f.tensors["q4"]
    assert kept.tobytes() == built.data[t.offset : t.offset + t.nbytes]
    f.close()  # twice is fine
    assert "closed" in repr(f)
    g = GGUFFile(path)  # the constructor is open()
    g.close()


# -- files written by gguf-py ---------------------------------------------------------


def test_a_file_written_by_gguf_py(gguf: Any, tmp_path: Path) -> None:
    """Metadata of every type, tensors of several types and odd shapes."""
    Q = gguf.GGMLQuantizationType
    path = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_uint8("u8", 200)
    w.add_int8("i8", -5)
    w.add_uint16("u16", 60000)
    w.add_int16("i16", -300)
    w.add_uint32("qwen3.block_count", 28)
    w.add_int32("i32", -(2**31))
    w.add_float32("qwen3.rope.freq_base", 1000000.0)
    w.add_float32("eps", 1e-6)
    w.add_bool("flag", True)
    w.add_string("tokenizer.chat_template", "{{ messages }} ✓")
    w.add_uint64("u64", 2**64 - 1)
    w.add_int64("i64", -(2**63))
    w.add_float64("f64", math.pi)
    w.add_array("tokenizer.ggml.tokens", ["<|im_start|>", "Ġhello", "é", "\n"])
    w.add_array("tokenizer.ggml.merges", ["Ġ h", "e l"])
    w.add_array("ints", [1, -2, 3])
    w.add_array("floats", [0.5, 1e-3])
    w.add_array("bools", [True, False])
    w.add_array("nested", [[1, 2], [3]])
    w.add_key_value(
        "u8s", [1, 2, 3], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8
    )

    rng = np.random.default_rng(0)
    f32 = rng.standard_normal(7).astype(np.float32)
    f16 = rng.standard_normal((2, 1, 3, 5)).astype(np.float16)
    f64 = rng.standard_normal((3,))
    one = np.array([4.0], dtype=np.float32)
    q8 = gguf.quants.quantize(
        rng.standard_normal((3, 2, 64)).astype(np.float32), Q.Q8_0
    )
    bf16 = gguf.quants.quantize(rng.standard_normal((5, 3)).astype(np.float32), Q.BF16)
    q4k = gb.random_blocks(rng, "Q4_K", 4, 144).reshape(2, 2 * 144)
    q6k = gb.random_blocks(rng, "Q6_K", 3, 210).reshape(3, 210)
    w.add_tensor("f32", f32)
    w.add_tensor("f16", f16)
    w.add_tensor("f64", f64)
    w.add_tensor("one", one)
    w.add_tensor("q8", q8, raw_dtype=Q.Q8_0)
    w.add_tensor("bf16", bf16, raw_dtype=Q.BF16)
    w.add_tensor("q4k", q4k, raw_dtype=Q.Q4_K)
    w.add_tensor("q6k", q6k, raw_dtype=Q.Q6_K)
    write_out(w)

    with GGUFFile.open(path) as f:
        md = f.metadata
        assert md["general.architecture"] == "qwen3"
        assert md["u8"] == 200 and md["i8"] == -5 and md["u16"] == 60000
        assert md["i16"] == -300 and md["qwen3.block_count"] == 28
        assert (
            md["i32"] == -(2**31) and md["u64"] == 2**64 - 1 and md["i64"] == -(2**63)
        )
        assert md["qwen3.rope.freq_base"] == 1000000.0
        assert md["eps"] == float(np.float32(1e-6)) and md["f64"] == math.pi
        assert md["flag"] is True
        assert md["tokenizer.chat_template"] == "{{ messages }} ✓"
        assert md["tokenizer.ggml.tokens"] == ["<|im_start|>", "Ġhello", "é", "\n"]
        assert md["tokenizer.ggml.merges"] == ["Ġ h", "e l"]
        assert md["ints"].dtype == np.int32 and md["ints"].tolist() == [1, -2, 3]
        assert md["floats"].dtype == np.float32
        assert md["floats"].tolist() == [0.5, float(np.float32(1e-3))]
        assert md["bools"] == [True, False]
        assert [a.tolist() for a in md["nested"]] == [[1, 2], [3]]
        assert md["u8s"].dtype == np.uint8 and md["u8s"].tolist() == [1, 2, 3]

        expected_shapes = {
            "f32": (7,), "f16": (2, 1, 3, 5), "f64": (3,), "one": (1,),
            "q8": (3, 2, 64), "bf16": (5, 3), "q4k": (2, 512), "q6k": (3, 256),
        }  # fmt: skip
        assert {n: t.shape for n, t in f.tensors.items()} == expected_shapes
        assert_bit_equal(f.dequantize("f32"), f32)
        assert_bit_equal(f.dequantize("f16"), f16.astype(np.float32))
        assert_bit_equal(f.dequantize("f64"), f64.astype(np.float32))
        compare_with_gguf_reader(gguf, f, path)


def compare_with_gguf_reader(gguf: Any, f: GGUFFile, path: Path) -> None:
    """Our metadata, tensor infos and values equal GGUFReader's + gguf-py's."""
    reader = gguf.GGUFReader(path)
    assert reader.data_offset == f.data_offset
    fields = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(f.metadata)
    for key, field in fields.items():
        ours = f.metadata[key]
        if isinstance(ours, list) and ours and isinstance(ours[0], list | np.ndarray):
            continue  # gguf-py flattens nested arrays; checked by value above
        if isinstance(ours, np.ndarray):
            ours = ours.tolist()
        assert ours == field.contents(), key
        assert int(f.value_types[key]) == int(field.types[0]), key
    assert [t.name for t in reader.tensors] == list(f.tensors)
    for rt in reader.tensors:
        t = f.tensors[rt.name]
        assert int(t.type) == int(rt.tensor_type)
        assert t.shape == tuple(reversed([int(d) for d in rt.shape]))
        assert (t.offset, t.nbytes) == (rt.data_offset, rt.n_bytes)
        if t.type is GGMLType.F64:  # gguf-py has no F64 "dequantizer"
            theirs = rt.data.astype(np.float32)
        elif t.type in DEQUANTIZABLE:
            theirs = gguf.quants.dequantize(rt.data, rt.tensor_type)
        else:
            continue
        ours = f.dequantize(rt.name)
        assert_bit_equal(ours, np.asarray(theirs, np.float32).reshape(t.shape))


# -- the real model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = resolve_model(SMOLLM2)
    assert path is not None
    return path


@pytest.mark.real
def test_real_smollm2_matches_gguf_py(gguf: Any, smollm2: Path) -> None:
    with GGUFFile.open(smollm2) as f:
        md = f.metadata
        assert md["general.architecture"] == "llama"
        assert md["llama.block_count"] == 30 and md["llama.embedding_length"] == 576
        assert len(md["tokenizer.ggml.tokens"]) == md["llama.vocab_size"] == 49152
        assert len(f.tensors) == 272
        assert f.tensors["token_embd.weight"].shape == (49152, 576)
        assert f.tensors["blk.0.ffn_down.weight"].shape == (576, 1536)
        compare_with_gguf_reader(gguf, f, smollm2)


# -- broken files ------------------------------------------------------------------------


def test_missing_empty_and_non_regular_files(tmp_path: Path) -> None:
    open_fails(tmp_path / "absent.gguf", "cannot open")
    open_fails(write(tmp_path, b""), "empty")
    (tmp_path / "dir.gguf").mkdir()
    open_fails(tmp_path / "dir.gguf", "not a regular file")


def test_bad_magic_and_versions(tmp_path: Path) -> None:
    good = gb.sample_file().data
    open_fails(write(tmp_path, b"GGML" + good[4:]), "not a GGUF file", "byte offset 0")
    open_fails(write(tmp_path, gb.build(version=1).data), "version 1", "byte offset 4")
    open_fails(write(tmp_path, gb.build(version=4).data), "version 4")
    big_endian = good[:4] + (3).to_bytes(4, "big") + good[8:]
    open_fails(write(tmp_path, big_endian), "big-endian")


def _truncation_points() -> list[tuple[str, int]]:
    built = gb.sample_file()
    return [
        ("in the magic", 3),
        ("in the version", 6),
        ("in the tensor count", 12),
        ("in the metadata count", 20),
        ("in a key length", built.kv_start + 4),
        ("in a key", built.kv_start + 10),
        ("in a value", built.kv_offsets[1] + 8 + len("llama.block_count") + 4 + 2),
        ("in the token strings", built.kv_offsets[3] + 40),
        ("in a tensor name", built.ti_start + 9),
        ("in a tensor's dimensions", built.ti_offsets[1] + 8 + len("half") + 4 + 3),
        ("in a tensor's offset", built.ti_offsets[-1] - 1),
    ]


@pytest.mark.parametrize(("where", "size"), _truncation_points())
def test_truncated_header(tmp_path: Path, where: str, size: int) -> None:
    data = gb.sample_file().data[:size]
    error = open_fails(write(tmp_path, data), "byte offset")
    message = str(error)
    assert f"file ({size} bytes) ends" in message or "can hold" in message, where
    assert error.__cause__ is None  # found by a check, not by the safety net


@pytest.mark.parametrize("cut", ["padding", "first tensor", "last tensor", "last byte"])
def test_truncated_data(tmp_path: Path, cut: str) -> None:
    built = gb.sample_file()
    size = {
        "padding": built.data_start - 1,
        "first tensor": built.data_start + 5,
        "last tensor": built.tensor_offsets["q6k"] + 100,
        "last byte": built.tensor_offsets["q6k"] + 209,
    }[cut]
    victim = "norm.weight" if cut in ("padding", "first tensor") else "q6k"
    open_fails(
        write(tmp_path, built.data[:size]),
        f"tensor {victim!r}",
        "runs past the end of the file",
        f"byte offset {built.tensor_offsets[victim]}",
    )


def test_absurd_lengths_do_not_allocate(tmp_path: Path) -> None:
    cases = [
        (gb.build([gb.gstr("k", length=2**60) + b"rest"]), "metadata key #0"),
        (
            gb.build([gb.gstr("k") + gb.u32(gb.STRING) + gb.u64(2**60)]),
            "metadata value 'k'",
        ),
        (
            gb.build(
                [gb.gstr("k") + gb.u32(gb.ARRAY) + gb.u32(gb.STRING) + gb.u64(2**60)]
            ),
            "claims 1152921504606846976 STRING elements",
        ),
        (
            gb.build(
                [gb.gstr("k") + gb.u32(gb.ARRAY) + gb.u32(gb.UINT64) + gb.u64(2**61)]
            ),
            "claims 2305843009213693952 UINT64 elements",
        ),
        (
            gb.build([gb.kv("k", gb.UINT8, 1)], n_kv=2**60),
            "claims 1152921504606846976 metadata",
        ),
        (gb.build(n_tensors=2**62), "claims 4611686018427387904 tensors"),
        (
            gb.build(
                [
                    gb.gstr("tokens")
                    + gb.u32(gb.ARRAY)
                    + gb.u32(gb.STRING)
                    + gb.u64(2)
                    + gb.gstr("a")
                    + gb.u64(2**64 - 1)
                    + b"x"
                ]
            ),
            "metadata value 'tokens'[1] (18446744073709551615 bytes)",
        ),
    ]
    for built, fragment in cases:
        path = write(tmp_path, built.data)
        tracemalloc.start()
        try:
            open_fails(path, fragment, "byte offset")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, (fragment, peak)


def test_bad_values(tmp_path: Path) -> None:
    cases: list[tuple[list[bytes], str]] = [
        ([gb.gstr("k") + gb.u32(13) + b"\x00"], "unknown value type 13"),
        (
            [gb.gstr("k") + gb.u32(gb.ARRAY) + gb.u32(99) + gb.u64(0)],
            "unknown value type 99",
        ),
        ([gb.gstr(b"\xff\xfe") + gb.u32(gb.UINT8) + b"\x01"], "not valid UTF-8"),
        ([gb.kv("k", gb.STRING, b"\xc3")], "metadata value 'k' is not valid UTF-8"),
        ([gb.kv("k", gb.UINT8, 1), gb.kv("k", gb.UINT8, 2)], "metadata key 'k' twice"),
        ([gb.kv("general.alignment", gb.UINT32, 0)], "general.alignment is 0"),
        ([gb.kv("general.alignment", gb.UINT32, 48)], "general.alignment is 48"),
        ([gb.kv("general.alignment", gb.STRING, "32")], "general.alignment is '32'"),
        ([gb.kv("general.alignment", gb.BOOL, True)], "general.alignment is True"),
    ]
    deep: Any = (gb.UINT8, [1])
    for _ in range(20):
        deep = (gb.ARRAY, [deep])
    cases.append(([gb.kv("deep", gb.ARRAY, deep)], "nests arrays more than 8 deep"))
    for kvs, fragment in cases:
        open_fails(write(tmp_path, gb.build(kvs).data), fragment)


def test_bad_utf8_in_an_array_is_refused_when_the_array_is_read(
    tmp_path: Path,
) -> None:
    """Decoding is most of a string array's time: open checks the layout,
    the lookup decodes (and names the element and its byte offset)."""
    nested = (gb.ARRAY, [(gb.STRING, [b"x"]), (gb.STRING, [b"\xff"])])
    kvs = [
        gb.kv("t", gb.ARRAY, (gb.STRING, [b"ok", b"\xe2\x82"])),
        gb.kv("n", gb.ARRAY, nested),
        gb.kv("k", gb.UINT8, 1),
    ]
    path = write(tmp_path, gb.build(kvs).data)
    with GGUFFile.open(path) as f:
        assert f.metadata["k"] == 1
        for key, fragment in [("t", "'t'[1]"), ("n", "'n'[1][0]")]:
            with pytest.raises(ModelLoadError) as info:
                f.metadata[key]
            message = str(info.value)
            assert str(path) in message and "byte offset" in message
            assert f"metadata value {fragment} is not valid UTF-8" in message


def test_bad_tensor_infos(tmp_path: Path) -> None:
    f32 = np.zeros(4, "<f4").tobytes()
    T = gb.Tensor
    cases: list[tuple[gb.Built, tuple[str, ...]]] = [
        (gb.build([], [T("w", [4], 4, f32)]), ("tensor 'w' has unknown GGML type 4",)),
        (gb.build([], [T("w", [4], 1000, f32)]), ("unknown GGML type 1000",)),
        (gb.build([], [T("w", [1, 1, 1, 1, 4], 0, f32)]), ("'w' has 5 dimensions",)),
        (
            gb.build([], [T("w", [33], 2, bytes(36))]),
            ("'w' (Q4_0, shape (33,))", "whole number"),
        ),
        (gb.build([], [T("w", [2**40, 2**40], 0, f32)]), ("'w'", "runs past the end")),
        (gb.build([], [T("w", [2**62, 2**62], 0, f32)]), ("'w'", "runs past the end")),
        (gb.build([], [T("w", [2**63], 0, f32)]), ("past 2**63",)),
        (
            gb.build([], [T("w", [4], 0, f32)], offsets=[2**30]),
            ("'w'", "runs past the end"),
        ),
        (
            gb.build([], [T("w", [4], 0, f32)], offsets=[2**64 - 1]),
            ("'w'", "runs past the end"),
        ),
        (
            gb.build([], [T("w", [4], 0, f32), T("w", [4], 0, f32)]),
            ("tensor 'w' twice",),
        ),
        (
            gb.build(
                [], [T("a", [8], 0, f32 * 2), T("b", [4], 0, f32)], offsets=[0, 16]
            ),
            ("tensors 'a' and 'b' overlap",),
        ),
        (gb.build([], [T(b"\x80", [4], 0, f32)]), ("tensor #0 is not valid UTF-8",)),
    ]
    for built, fragments in cases:
        open_fails(write(tmp_path, built.data), *fragments)


def test_a_size_that_does_not_match_the_shape(tmp_path: Path) -> None:
    """A tensor info whose row count grew (a flipped bit) is caught by overlap."""
    built = gb.sample_file()
    data = bytearray(built.data)
    at = built.ti_offsets[2] + 8 + len("q4") + 4 + 8  # q4's ne[1] (2 -> 3)
    assert data[at] == 2
    data[at] = 3
    open_fails(write(tmp_path, bytes(data)), "tensors 'q4' and 'q8' overlap")


# -- fuzzing ----------------------------------------------------------------------------

SAMPLE = gb.sample_file().data


def check_never_crashes(path: Path, data: bytes) -> None:
    """Open and read everything: ModelLoadError is the only exception allowed."""
    path.write_bytes(data)
    try:
        f = GGUFFile.open(path)
    except ModelLoadError as exc:
        assert str(path) in str(exc)
        return
    with f:
        for key in f.metadata:  # arrays are read here
            try:
                f.metadata[key]
            except ModelLoadError as exc:
                assert str(path) in str(exc) and "not valid UTF-8" in str(exc)
        for t in f.tensors.values():
            assert t.offset + t.nbytes <= len(data)
            assert f.raw(t.name).size == t.nbytes
            try:
                out = f.dequantize(t.name)
            except ModelLoadError:
                assert t.type not in DEQUANTIZABLE
            else:
                assert out.shape == t.shape


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    cut=st.integers(0, len(SAMPLE)),
    edits=st.lists(
        st.tuples(st.integers(0, len(SAMPLE) - 1), st.integers(0, 255)), max_size=6
    ),
)
def test_fuzz_truncation_and_corruption(
    tmp_path: Path, cut: int, edits: list[tuple[int, int]]
) -> None:
    data = bytearray(SAMPLE)
    for at, value in edits:
        data[at] = value
    check_never_crashes(
        tmp_path / "fuzz.gguf", bytes(data[:cut] if cut < len(data) else data)
    )


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(flips=st.lists(st.integers(0, len(SAMPLE) * 8 - 1), min_size=1, max_size=4))
def test_fuzz_bit_flips(tmp_path: Path, flips: list[int]) -> None:
    data = bytearray(SAMPLE)
    for bit in flips:
        data[bit // 8] ^= 1 << (bit % 8)
    check_never_crashes(tmp_path / "flip.gguf", bytes(data))


def test_every_truncation_of_the_header(tmp_path: Path) -> None:
    built = gb.sample_file()
    for size in range(built.data_start + 1):
        check_never_crashes(tmp_path / "cut.gguf", built.data[:size])


def test_the_dequantizable_types_are_those_with_a_dequantizer() -> None:
    """``quants.DEQUANTIZABLE`` (numpy-free, what a refusal names) lists
    exactly the types ``formats.blocks`` has a numpy dequantizer for."""
    from structllm.formats import blocks, quants

    assert frozenset(blocks._DEQUANT) == quants.DEQUANTIZABLE
