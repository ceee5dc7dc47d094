"""GGUF metadata values and a checked cursor over a mapped file.

:class:`GGUFValueType` numbers a metadata value's type as ``enum gguf_type``
does; :class:`Parser` reads integers, strings, values and arrays from a
memory map, checking every length and count against the file's size before
it trusts it, so that :class:`~structllm.formats.gguf.GGUFFile` raises
:class:`~structllm.errors.ModelLoadError` (naming the file, the field and
the byte offset) for a truncated or hostile file instead of allocating.
:class:`GGUFMetadata` is the file's metadata with its arrays left in the map
until they are looked up.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from enum import IntEnum
from pathlib import Path
from typing import Any

import attrs

from structllm.errors import ModelLoadError

__all__ = ["MAX_ARRAY_NESTING", "Deferred", "GGUFMetadata", "GGUFValueType", "Parser"]

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

    def __init__(self, buf: mmap.mmap, size: int, path: Path, pos: int = 0) -> None:
        self.buf = buf
        self.size = size
        self.path = path
        self.pos = pos

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

    def array_head(self, what: str, depth: int) -> tuple[GGUFValueType, int]:
        """An array's element type and count, checked against the bytes left."""
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
        return kind, count

    def skip_array(self, what: str, depth: int = 0) -> int:
        """Check an array's layout as :meth:`array` does (every count,
        length and nesting) and step past it, keeping none of it: its count.
        Its strings' UTF-8 is checked when :meth:`array` reads them.

        A tokenizer's arrays are most of a file's metadata, and a reader
        that only needs the model's shape should not hold 50-150k strings.
        """
        kind, count = self.array_head(what, depth)
        if kind in _SCALAR:
            self.pos += count * _MIN_SIZE[kind]
        elif kind is _V.STRING:
            self.skip_strings(count, what)
        else:
            for i in range(count):
                self.skip_array(f"{what}[{i}]", depth + 1)
        return count

    def array(self, what: str, depth: int, *, lists: bool = False) -> Any:
        """The array at the cursor: numbers as a numpy array, or with
        ``lists`` as a list of Python numbers (read without numpy)."""
        kind, count = self.array_head(what, depth)
        if kind in _SCALAR and kind is not _V.BOOL:
            fmt, dtype = _SCALAR[kind]
            n = count * _MIN_SIZE[kind]
            if lists:
                numbers = struct.unpack_from(f"<{count}{fmt[1:]}", self.buf, self.pos)
                self.pos += n
                return list(numbers)
            import numpy as np

            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += n
            return values.astype(dtype[1:])  # native order, owns its memory
        if kind is _V.BOOL:
            raw = self.buf[self.pos : self.pos + count]
            self.pos += count
            return [b != 0 for b in raw]
        if kind is _V.STRING:
            return self.strings(count, what)
        return [
            self.array(f"{what}[{i}]", depth + 1, lists=lists) for i in range(count)
        ]

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

    def skip_strings(self, count: int, what: str) -> None:
        """Step past ``count`` strings, checking each length (not the UTF-8:
        decoding is most of :meth:`strings`' time)."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        for i in range(count):
            if size - pos < 8:
                self.pos = pos
                self.need(8, f"the length of {what}[{i}]")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos
                self.need(n, f"{what}[{i}] ({n} bytes)")
            pos += n
        self.pos = pos


def _release_pages(buf: mmap.mmap, end: int) -> None:
    """Drop ``buf``'s first ``end`` bytes (whole pages) from resident memory;
    they stay mapped."""
    if end and hasattr(mmap, "MADV_DONTNEED"):
        with contextlib.suppress(ValueError, OSError):  # closed, or refused
            buf.madvise(mmap.MADV_DONTNEED, 0, end)


@attrs.frozen
class Deferred:
    """An array left in the file: where it starts and how many elements."""

    offset: int
    count: int


class GGUFMetadata(Mapping[str, Any]):
    """A GGUF file's metadata, in file order, with arrays read on demand.

    Scalars and strings were read when the file was opened; an array (the
    tokenizer's tokens, merges, scores and types are most of a file's
    metadata: 10 MiB of Python objects for a 49k-token vocabulary) was
    checked then and is parsed from the map each time it is looked up, a new
    copy its caller owns, so a reader that only needs the model's shape
    never builds it. :meth:`array_length` counts one without reading it.

    While the file is open an array is read from its map; after
    :meth:`GGUFFile.close` the file is mapped again for the read (and must
    still be its size), so that closing it unmaps it whatever the metadata's
    lifetime. The header's pages are dropped from the process's resident
    memory once read (at open and after each array): they are the file's,
    read back on the next touch, and a quantized model keeps its file mapped
    for good.
    """

    def __init__(
        self, values: dict[str, Any], buf: mmap.mmap, size: int, path: Path, end: int
    ) -> None:
        """``values`` as the open read them (a :class:`Deferred` per array),
        ``end`` where the header ends (the tensor data's offset)."""
        self._values = values
        self._map = buf
        self._size = size
        self._path = path
        self._end = end - end % mmap.PAGESIZE
        _release_pages(buf, self._end)

    def __getitem__(self, key: str) -> Any:
        return self._lookup(key, lists=False)

    def as_list(self, key: str) -> Any:
        """``self.get(key)``, but an array of numbers as a list of Python
        numbers, read without numpy (a tokenizer's token types and scores,
        which the server's front end reads)."""
        return self._lookup(key, lists=True) if key in self._values else None

    def _lookup(self, key: str, *, lists: bool) -> Any:
        value = self._values[key]
        if type(value) is not Deferred:
            return value
        if not self._map.closed:
            return self._read(self._map, key, value, lists)
        where = str(self._path)
        try:
            with open(self._path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != self._size:
                    raise ModelLoadError(
                        f"GGUF file {where!r} changed size ({self._size} bytes when "
                        f"opened, {size} now) before {key!r} was read"
                    )
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ModelLoadError(
                f"cannot reopen GGUF file {where!r} to read {key!r}: {exc}"
            ) from exc
        with buf:
            return self._read(buf, key, value, lists)

    def _read(self, buf: mmap.mmap, key: str, value: Deferred, lists: bool) -> Any:
        p = Parser(buf, self._size, self._path, value.offset)
        try:
            return p.array(f"metadata value {key!r}", 0, lists=lists)
        except ModelLoadError:
            raise
        except (struct.error, ValueError, OverflowError, IndexError) as exc:
            # a check the open's walk lacks: still the file's fault
            raise p.fail(f"metadata value {key!r} is corrupt: {exc!r}") from exc
        finally:
            _release_pages(buf, self._end)

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def array_length(self, key: str) -> int | None:
        """How many elements the array ``key`` has, without reading them;
        None if ``key`` is absent or not an array."""
        value = self._values.get(key)
        if type(value) is Deferred:
            return value.count
        return None

    def __repr__(self) -> str:
        return f"<GGUFMetadata {str(self._path)!r}, {len(self)} keys>"
