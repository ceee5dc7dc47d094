"""GGUF files built byte by byte: well-formed ones, and ones broken on purpose.

No dependency on the ``gguf`` package: every field is written by hand, so a
test can put any count, length, type or offset into any place (the ``gguf``
writer refuses most of what a hostile file holds).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# GGUF value types (gguf.h's enum gguf_type)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL = range(8)
STRING, ARRAY, UINT64, INT64, FLOAT64 = range(8, 13)

SCALAR_FORMAT = {
    UINT8: "<B",
    INT8: "<b",
    UINT16: "<H",
    INT16: "<h",
    UINT32: "<I",
    INT32: "<i",
    FLOAT32: "<f",
    BOOL: "<?",
    UINT64: "<Q",
    INT64: "<q",
    FLOAT64: "<d",
}


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def gstr(text: str | bytes, *, length: int | None = None) -> bytes:
    """A GGUF string: u64 length, then the bytes (``length`` overrides it)."""
    raw = text.encode() if isinstance(text, str) else text
    return u64(len(raw) if length is None else length) + raw


def payload(vtype: int, value: Any) -> bytes:
    """A value without its type tag. An array is ``(element_type, items)``."""
    if vtype == STRING:
        return gstr(value)
    if vtype == ARRAY:
        etype, items = value
        return u32(etype) + u64(len(items)) + b"".join(payload(etype, v) for v in items)
    return struct.pack(SCALAR_FORMAT[vtype], value)


def kv(key: str | bytes, vtype: int, value: Any) -> bytes:
    """One metadata entry: key, type tag, value."""
    return gstr(key) + u32(vtype) + payload(vtype, value)


def tensor_info(
    name: str | bytes, ne: Sequence[int], ggml_type: int, offset: int
) -> bytes:
    """One tensor info; ``ne`` innermost first, as GGUF stores it."""
    return (
        gstr(name)
        + u32(len(ne))
        + b"".join(u64(d) for d in ne)
        + u32(ggml_type)
        + u64(offset)
    )


@dataclass
class Tensor:
    name: str
    ne: list[int]  # innermost first
    ggml_type: int
    data: bytes


@dataclass
class Built:
    """A file's bytes, and where its sections begin."""

    data: bytes
    kv_start: int  # first metadata entry
    kv_offsets: list[int]
    ti_start: int  # first tensor info
    ti_offsets: list[int]
    data_start: int  # tensor data section (after padding)
    tensor_offsets: dict[str, int] = field(default_factory=dict)  # absolute


def build(
    kvs: Sequence[bytes] = (),
    tensors: Sequence[Tensor] = (),
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    alignment: int = 32,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    offsets: Sequence[int] | None = None,
) -> Built:
    """A GGUF file of these entries and tensors, data padded to ``alignment``.

    ``n_kv``/``n_tensors`` override the header's counts; ``offsets`` the
    tensor infos' data offsets (relative to the data section).
    """
    header = magic + u32(version)
    header += u64(len(tensors) if n_tensors is None else n_tensors)
    header += u64(len(kvs) if n_kv is None else n_kv)
    kv_start = len(header)
    kv_offsets = []
    pos = kv_start
    for entry in kvs:
        kv_offsets.append(pos)
        pos += len(entry)
    relative = []
    pos_data = 0
    for t in tensors:
        relative.append(pos_data)
        pos_data += -(-len(t.data) // alignment) * alignment
    if offsets is not None:
        relative = list(offsets)
    infos = [
        tensor_info(t.name, t.ne, t.ggml_type, off)
        for t, off in zip(tensors, relative, strict=True)
    ]
    ti_start = pos
    ti_offsets = []
    for info in infos:
        ti_offsets.append(pos)
        pos += len(info)
    data_start = -(-pos // alignment) * alignment
    out = bytearray(header + b"".join(kvs) + b"".join(infos))
    out += bytes(data_start - len(out))
    if offsets is None:
        for t in tensors:
            out += t.data + bytes(-len(t.data) % alignment)
    else:  # each tensor's bytes where its offset says, if that is not absurd
        region = bytearray()
        for t, off in zip(tensors, relative, strict=True):
            if off + len(t.data) <= 1 << 24:
                region += bytes(max(0, off + len(t.data) - len(region)))
                region[off : off + len(t.data)] = t.data
        out += region
    built = Built(bytes(out), kv_start, kv_offsets, ti_start, ti_offsets, data_start)
    built.tensor_offsets = {
        t.name: data_start + off for t, off in zip(tensors, relative, strict=True)
    }
    return built


# -- random tensor payloads -------------------------------------------------------

# byte offsets of each type's f16 scale fields within a block
F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(
    rng: np.random.Generator, type_name: str, n_blocks: int, bytes_per_block: int
) -> np.ndarray:
    """Random blocks whose f16 scales are finite (float types: finite values)."""
    blocks = rng.integers(0, 256, size=(n_blocks, bytes_per_block), dtype=np.uint8)
    if type_name in ("F16", "F32", "F64"):
        values = rng.standard_normal(n_blocks).astype(
            {"F16": "<f2", "F32": "<f4", "F64": "<f8"}[type_name]
        )
        return values.view(np.uint8).reshape(n_blocks, bytes_per_block)
    if type_name == "BF16":
        values = rng.standard_normal(n_blocks).astype("<f4").view("<u4") >> 16
        return values.astype("<u2").view(np.uint8).reshape(n_blocks, 2)
    for at in F16_FIELDS.get(type_name, ()):
        scales = (rng.standard_normal(n_blocks) * 0.05).astype("<f2")
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def sample_file(seed: int = 0) -> Built:
    """A small well-formed file: metadata of many types, several tensor types."""
    rng = np.random.default_rng(seed)

    def data(type_name: str, n_blocks: int, size: int) -> bytes:
        return random_blocks(rng, type_name, n_blocks, size).tobytes()

    kvs = [
        kv("general.architecture", STRING, "llama"),
        kv("llama.block_count", UINT32, 2),
        kv("llama.rope.freq_base", FLOAT32, 10000.0),
        kv("tokenizer.ggml.tokens", ARRAY, (STRING, ["<s>", "a", "bé", "ĠĠ"])),
        kv("tokenizer.ggml.scores", ARRAY, (FLOAT32, [0.0, -1.0, -2.5, 3.0])),
        kv("tokenizer.ggml.token_type", ARRAY, (INT32, [3, 1, 1, 1])),
        kv("flags", ARRAY, (BOOL, [True, False])),
        kv("nested", ARRAY, (ARRAY, [(UINT8, [1, 2]), (STRING, ["x"])])),
        kv("big", INT64, -(2**62)),
    ]
    tensors = [
        Tensor("norm.weight", [8], 0, data("F32", 8, 4)),
        Tensor("half", [4, 3], 1, data("F16", 12, 2)),
        Tensor("q4", [64, 2], 2, data("Q4_0", 4, 18)),
        Tensor("q8", [32, 3], 8, data("Q8_0", 3, 34)),
        Tensor("q4k", [256, 2], 12, data("Q4_K", 2, 144)),
        Tensor("q6k", [256], 14, data("Q6_K", 1, 210)),
    ]
    return build(kvs, tensors)
