"""GGUF metadata values and a checked cursor over a mapped file.

:class:`GGUFValueType` numbers a metadata value's type as ``enum gguf_type``
does; :class:`Parser` reads integers, strings, values and arrays from a
memory map, checking every length and count against the file's size before
it trusts it, so that :class:`~structllm.formats.gguf.GGUFFile` raises
:class:`~structllm.errors.ModelLoadError` (naming the file, the field and
the byte offset) for a truncated or hostile file instead of allocating.
"""

from __future__ import annotations

import mmap
import struct
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np

from structllm.errors import ModelLoadError

__all__ = ["MAX_ARRAY_NESTING", "GGUFValueType", "Parser"]

MAX_ARRAY_NESTING = 8  # llama.cpp reads no nested arrays at all; gguf-py writes them


class GGUFValueType(IntEnum):
    """The type of a metadata value (``enum gguf_type``)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_V = GGUFValueType
# struct format and numpy dtype of each fixed-size value type
_SCALAR: dict[GGUFValueType, tuple[str, str]] = {
    _V.UINT8: ("<B", "<u1"),
    _V.INT8: ("<b", "<i1"),
    _V.UINT16: ("<H", "<u2"),
    _V.INT16: ("<h", "<i2"),
    _V.UINT32: ("<I", "<u4"),
    _V.INT32: ("<i", "<i4"),
    _V.FLOAT32: ("<f", "<f4"),
    _V.BOOL: ("<?", "<u1"),
    _V.UINT64: ("<Q", "<u8"),
    _V.INT64: ("<q", "<i8"),
    _V.FLOAT64: ("<d", "<f8"),
}
# the fewest bytes one value of each type takes (to bound an array's count)
_MIN_SIZE: dict[GGUFValueType, int] = {
    **{t: struct.calcsize(fmt) for t, (fmt, _) in _SCALAR.items()},
    _V.STRING: 8,
    _V.ARRAY: 12,
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class Parser:
    """A cursor over the mapped file that checks every read against its size."""

    def __init__(self, buf: mmap.mmap, size: int, path: Path) -> None:
        self.buf = buf
        self.size = size
        self.path = path
        self.pos = 0

    def fail(self, problem: str, at: int | None = None) -> ModelLoadError:
        where = f" at byte offset {at}" if at is not None else ""
        return ModelLoadError(f"GGUF file {str(self.path)!r}: {problem}{where}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(
                f"{what} needs {n} bytes but the file ({self.size} bytes) ends first",
                self.pos,
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(value)

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(value)

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(
                f"{what} is not valid UTF-8 ({exc.reason})", start
            ) from None

    def value_type(self, what: str) -> GGUFValueType:
        at = self.pos
        raw = self.u32(f"the type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"{what} has unknown value type {raw}", at) from None

    def value(self, kind: GGUFValueType, what: str, depth: int = 0) -> Any:
        if kind is _V.STRING:
            return self.string(what)
        if kind is _V.ARRAY:
            return self.array(what, depth)
        fmt, _ = _SCALAR[kind]
        size = _MIN_SIZE[kind]
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def array(self, what: str, depth: int) -> Any:
        start = self.pos
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(
                f"{what} nests arrays more than {MAX_ARRAY_NESTING} deep", start
            )
        kind = self.value_type(f"the elements of {what}")
        count = self.u64(f"the length of {what}")
        if count > (self.size - self.pos) // _MIN_SIZE[kind]:
            raise self.fail(
                f"{what} claims {count} {kind.name} elements, more than the "
                f"{self.size - self.pos} bytes left in the file can hold",
                start,
            )
        if kind in _SCALAR and kind is not _V.BOOL:
            _, dtype = _SCALAR[kind]
            n = count * _MIN_SIZE[kind]
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += n
            return values.astype(dtype[1:])  # native order, owns its memory
        if kind is _V.BOOL:
            raw = self.buf[self.pos : self.pos + count]
            self.pos += count
            return [b != 0 for b in raw]
        if kind is _V.STRING:
            return self.strings(count, what)
        return [self.array(f"{what}[{i}]", depth + 1) for i in range(count)]

    def strings(self, count: int, what: str) -> list[str]:
        # the hot loop of a tokenizer's 50-150k tokens: locals only
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(count):
            if size - pos < 8:
                self.pos = pos
                self.need(8, f"the length of {what}[{i}]")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos
                self.need(n, f"{what}[{i}] ({n} bytes)")
            try:
                append(buf[pos : pos + n].decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise self.fail(
                    f"{what}[{i}] is not valid UTF-8 ({exc.reason})", pos - 8
                ) from None
            pos += n
        self.pos = pos
        return out
