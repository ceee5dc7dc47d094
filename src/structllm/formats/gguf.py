"""A reader of GGUF files (llama.cpp's model format), on a memory map.

The layout (little-endian; versions 2 and 3, which differ only in that 3 may
also be big-endian, which this reader refuses)::

    "GGUF"  u32 version  u64 n_tensors  u64 n_kv
    n_kv x      key: string  u32 value_type  value
    n_tensors x name: string  u32 n_dims  u64 ne[n_dims]  u32 ggml_type  u64 offset
    padding to `general.alignment` (default 32)
    tensor data; each tensor at data_start + offset

    string = u64 length + UTF-8 bytes;  array = u32 element_type  u64 count  elements

``ne`` lists dimensions innermost first; a tensor's ``shape`` here is numpy's
order, ``ne`` reversed (a weight with ``ne = [in, out]`` has shape
``(out, in)``).

:meth:`GGUFFile.open` parses the header, every metadata value (an array's
elements: only checked, read when looked up) and every tensor info straight
from the map (no read of the whole file) and checks every
count, length, type and range against the file's size before it trusts it,
so a truncated, corrupt or hostile file raises
:class:`~structllm.errors.ModelLoadError` (naming the file, and the key or
tensor and byte offset) instead of allocating, crashing or hanging.
Tensor bytes are not read until :meth:`GGUFFile.raw` or
:meth:`GGUFFile.dequantize` is called.

Only numpy, attrs and the standard library: both the text layer (tokenizer
from ``tokenizer.ggml.*``) and the model layer import this module.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import os
import stat
import struct
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import attrs

from structllm.errors import ModelLoadError
from structllm.formats import quants
from structllm.formats.gguf_values import Deferred, GGUFMetadata, GGUFValueType, Parser
from structllm.formats.quants import GGMLType

if TYPE_CHECKING:  # a tensor's bytes are numpy's; the metadata needs none
    import numpy as np
    import numpy.typing as npt

__all__ = ["GGUFFile", "GGUFMetadata", "GGUFTensor", "GGUFValueType"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses more


@attrs.frozen
class GGUFTensor:
    """One tensor's info: where its bytes are and what they hold."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    """numpy order: GGUF's ``ne`` reversed."""
    offset: int
    """absolute byte offset of the data in the file"""
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class GGUFFile:
    """An open GGUF file: its metadata, its tensor infos, and their bytes.

    ``metadata`` (a :class:`GGUFMetadata`) maps each key, in file order, to
    its value: a ``str``, a Python ``int``, ``float`` or ``bool``, or for an
    array: a 1-D numpy array (native byte order, its own copy) when the
    elements are numbers (any integer or float type:
    ``tokenizer.ggml.token_type``, ``scores``, per-layer head counts), else a
    ``list`` (of ``str``: ``tokenizer.ggml.tokens`` and ``merges``; of
    ``bool``; or of the inner arrays, each by the same rule). An array's
    layout is checked at open, its elements read (its strings' UTF-8
    checked) only when it is looked up, each lookup a new copy: the model's
    config never builds the tokenizer's 50-150k strings.
    ``value_types`` gives each key's GGUF type (``ARRAY`` for arrays).

    ``tensors`` maps names to :class:`GGUFTensor` in file order. The file is
    memory-mapped; :meth:`raw` views it without copying. :meth:`close` (or
    leaving a ``with`` block) drops the map; arrays from :meth:`raw` keep it
    alive until they are gone.
    """

    path: Path
    version: int
    alignment: int
    data_offset: int
    metadata: GGUFMetadata
    value_types: dict[str, GGUFValueType]
    tensors: dict[str, GGUFTensor]

    _map: mmap.mmap | None
    _bytes: npt.NDArray[np.uint8] | None

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Same as :meth:`open`."""
        self.path = Path(path)
        self._map = None
        self._bytes = None
        where = str(self.path)
        try:
            st = os.stat(self.path)
            if not stat.S_ISREG(st.st_mode):
                raise ModelLoadError(f"GGUF file {where!r} is not a regular file")
            if st.st_size == 0:
                raise ModelLoadError(f"GGUF file {where!r} is empty")
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot open GGUF file {where!r}: {exc}") from exc
        self._map = buf
        try:
            self._parse(Parser(buf, size, self.path))
        except ModelLoadError:
            self.close()
            raise
        except (struct.error, ValueError, OverflowError, IndexError) as exc:
            self.close()  # a check this parser lacks: still the file's fault
            raise ModelLoadError(f"GGUF file {where!r} is corrupt: {exc!r}") from exc

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        """Map ``path`` and read its header, metadata and tensor infos.

        Raises ``ModelLoadError`` when the file cannot be read or is not a
        well-formed little-endian GGUF v2/v3 file.
        """
        return cls(path)

    def _parse(self, p: Parser) -> None:
        p.need(4, "the magic number")
        magic = p.buf[0:4]
        if magic != GGUF_MAGIC:
            raise p.fail(
                f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})", 0
            )
        p.pos = 4
        version = p.u32("the version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in SUPPORTED_VERSIONS:
                raise p.fail(
                    "the file is big-endian; only little-endian GGUF is read", 4
                )
            raise p.fail(f"GGUF version {version} is not supported (only 2 and 3)", 4)
        self.version = version
        n_tensors = p.u64("the tensor count")
        n_kv = p.u64("the metadata count")
        left = p.size - p.pos
        # a key/value takes at least 13 bytes, a tensor info 24
        if n_kv > left // 13:
            raise p.fail(
                f"the header claims {n_kv} metadata entries, more than the "
                f"{left} bytes after it can hold (truncated or corrupt?)",
                16,
            )
        if n_tensors > left // 24:
            raise p.fail(
                f"the header claims {n_tensors} tensors, more than the "
                f"{left} bytes after it can hold (truncated or corrupt?)",
                8,
            )

        values: dict[str, Any] = {}
        self.value_types = {}
        for i in range(n_kv):
            at = p.pos
            key = p.string(f"metadata key #{i}")
            what = f"metadata value {key!r}"
            vtype = p.value_type(what)
            if vtype is GGUFValueType.ARRAY:
                start = p.pos  # checked now, read when asked for
                value: Any = Deferred(start, p.skip_array(what))
            else:
                value = p.value(vtype, what)
            if key in values:
                raise p.fail(f"has metadata key {key!r} twice", at)
            values[key] = value
            self.value_types[key] = vtype

        alignment = values.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, Deferred):
            raise p.fail("general.alignment is an array, not a power of two")
        if (
            not isinstance(alignment, int)
            or isinstance(alignment, bool)
            or alignment <= 0
            or alignment & (alignment - 1)
            or alignment > 1 << 30
        ):
            raise p.fail(f"general.alignment is {alignment!r}, not a power of two")
        self.alignment = alignment

        infos: list[tuple[str, GGMLType, tuple[int, ...], int, int]] = []
        names: set[str] = set()
        for i in range(n_tensors):
            at = p.pos
            name = p.string(f"the name of tensor #{i}")
            what = f"tensor {name!r}"
            if name in names:
                raise p.fail(f"has tensor {name!r} twice", at)
            names.add(name)
            n_dims = p.u32(f"the dimension count of {what}")
            if n_dims > MAX_DIMS:
                raise p.fail(f"{what} has {n_dims} dimensions (at most {MAX_DIMS})", at)
            ne = [p.u64(f"the dimensions of {what}") for _ in range(n_dims)]
            type_at = p.pos
            raw_type = p.u32(f"the type of {what}")
            try:
                kind = GGMLType(raw_type)
            except ValueError:
                raise p.fail(
                    f"{what} has unknown GGML type {raw_type}", type_at
                ) from None
            offset = p.u64(f"the data offset of {what}")
            shape = tuple(reversed(ne))
            if any(d >= 1 << 63 for d in ne):
                raise p.fail(f"{what} has a dimension past 2**63: ne={ne}", at)
            try:
                nbytes = quants.tensor_nbytes(kind, shape)
            except ValueError as exc:
                raise p.fail(
                    f"{what} ({kind.name}, shape {shape}): {exc}", at
                ) from None
            infos.append((name, kind, shape, offset, nbytes))

        data_offset = -(-p.pos // alignment) * alignment
        self.data_offset = data_offset
        self.tensors = {}
        for name, kind, shape, offset, nbytes in infos:
            start = data_offset + offset
            if start + nbytes > p.size:
                raise p.fail(
                    f"the data of tensor {name!r} ({kind.name}, shape {shape}, "
                    f"{nbytes} bytes at byte offset {start}) runs past the end of "
                    f"the file ({p.size} bytes)"
                )
            self.tensors[name] = GGUFTensor(name, kind, shape, start, nbytes)

        spans = sorted(
            (t.offset, t.offset + t.nbytes, t.name)
            for t in self.tensors.values()
            if t.nbytes
        )
        for (_, end, first), (start, _, second) in itertools.pairwise(spans):
            if start < end:
                raise p.fail(
                    f"the data of tensors {first!r} and {second!r} overlap at "
                    f"byte offset {start} (a size that does not match its shape?)"
                )
        self.metadata = GGUFMetadata(values, p.buf, p.size, self.path, data_offset)

    # -- tensor data ----------------------------------------------------------------

    def _tensor(self, name: str) -> GGUFTensor:
        if self._map is None:
            raise ValueError(f"GGUF file {str(self.path)!r} is closed")
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(
                f"GGUF file {str(self.path)!r} has no tensor {name!r}"
            ) from None

    def raw(self, name: str) -> npt.NDArray[np.uint8]:
        """The tensor's bytes: a read-only uint8 view of the map, no copy.

        Raises ``ModelLoadError`` for an unknown name.
        """
        t = self._tensor(name)
        if self._bytes is None:  # the first tensor read: the map as numpy's bytes
            import numpy as np

            assert self._map is not None
            self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        return self._bytes[t.offset : t.offset + t.nbytes]

    def dequantize(self, name: str) -> npt.NDArray[np.float32]:
        """The tensor's values as a new float32 array of its numpy ``shape``.

        Raises ``ModelLoadError`` for an unknown name or a type without a
        dequantizer (see :data:`structllm.formats.quants.DEQUANTIZABLE`).
        """
        t = self._tensor(name)
        if t.type not in quants.DEQUANTIZABLE:
            raise ModelLoadError(
                f"GGUF file {str(self.path)!r}: tensor {name!r} has type "
                f"{t.type.name}, which structllm cannot dequantize (it reads "
                f"{', '.join(sorted(k.name for k in quants.DEQUANTIZABLE))})"
            )
        return quants.dequantize(self.raw(name), t.type, t.shape)

    # -- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Drop the map. Views from :meth:`raw` stay valid (they keep it alive)."""
        self._bytes = None
        buf, self._map = self._map, None
        if buf is not None:
            # arrays still viewing it keep it; it unmaps when they are collected
            with contextlib.suppress(BufferError):
                buf.close()

    @property
    def closed(self) -> bool:
        return self._map is None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.tensors)} tensors"
        return f"<GGUFFile {str(self.path)!r} v{self.version}, {state}>"
