"""CPU matmul kernels for weights kept in llama.cpp's GGUF block layout.

A weight of Hugging Face shape ``(out, in)`` stays as ``out`` rows of raw
bytes, ``np.uint8 (out, row_bytes(qtype, in))``: each row ``in /
values_per_block`` blocks of a scale (and a min) and packed integers, as
``ggml-common.h`` lays them out (a zero-copy view of a GGUF file's mmap, or
what :func:`structllm.model.quantize.quantize` returns). :func:`matmul` multiplies float32
activations ``x (T, in)`` by it without a float copy of the whole weight:

- Four rows at a time are dequantized into a small float32 buffer (a
  thread's own, 4 x 1024 values, 16 KB, in L1), a chunk of 1024 inputs at a
  time (by the GEMVs' vector dequantizers, 16 lanes a store), and every row
  of ``x`` is multiplied against them by a register-blocked micro-kernel:
  4 weight rows x 4 tokens, 16 running sums of 16 lanes each. The weight's bytes are read once a
  call whatever ``T`` is (batch 16 reads them once, not 16 times) and each
  value is dequantized once; tokens come in fours, the rest one by one.
- A single token (``T`` of 1, a decode step at batch 1) takes GEMV
  kernels instead, one a type: each row's blocks are dequantized into
  vector registers and multiplied with ``x`` there, 16 lanes at a time,
  into running sums that stay in registers to the end of the row (no float
  buffer; 1.3-1.8x the buffered kernel's speed on SmolLM2's step). Up to
  4 tokens (decode with a few concurrent streams) of a 32-value type take
  GEMVs of 4 and 2 tokens: each block dequantized into registers once and
  multiplied into every token's sums (``T`` of 2 costs 1.4-1.6x ``T`` of
  1 on a 3072 x 576 matrix, 1.5-1.7x faster than the buffered kernel).
  K-quants take them at one token only (see :data:`_GEMV_TOKENS`).
- Rows are spread over the engine's threads (:func:`set_num_threads` of
  :mod:`structllm.model.kernels`, the same OpenMP pool as the attention
  kernels), in contiguous runs of whole row quads.
- From ``_OUTER_TOKENS`` (32) tokens a call, prefill's sizes, whole
  32-row panels are transposed after dequantizing (16 x 16 blocks in
  registers) and each token's inputs broadcast into two vectors of 32
  rows' sums (:func:`_outer_rows`): no horizontal sum a row, 1.5-1.8x the
  micro-kernel at 136-512 tokens. For prefill, dequantizing 256-row tiles
  into numpy's BLAS had measured 10-20% faster than the micro-kernel on
  one thread and even on two, and float32 BLAS on float weights 30% faster
  than either (``tools/bench_quant_kernels.py --prefill 256``); with the
  outer-product panels the kernel is 1.4x the tiles and level with numpy's
  float32 BLAS on float weights (2 threads, 256 tokens: 1.0x at 1024 ->
  3072, 0.9x at 1536 -> 576), on the engine's OpenMP pool, with no Python
  loop over tiles.
- Activations stay float32 by default: ``x`` is not quantized, so the
  result is the float32 product with the dequantized weight, to rounding.
  ``activations="q8"`` does what llama.cpp does instead, for the 32-value
  types (:data:`Q8_TYPES`): ``x`` quantized once a call to Q8_0/Q8_1
  blocks, then a block's products are integers (64 bytes against 64, one
  ``vpdpbusd`` with AVX-512 VNNI, ``vpmaddubsw`` + ``vpmaddwd`` without,
  and on AVX2 as two 256-bit halves) and one float multiply-add by ``d_w
  d_x`` a block: 1.7-2x the float GEMV on one 3072 x 576 matrix at ``T``
  of 1, 1.3-1.5x at 2 and 4 (GEMVs of 4, 2 and 1 tokens, a pair of blocks
  unpacked once for all), and from 5 tokens the byte panels below. Q4_K
  and Q6_K (:data:`Q8K_TYPES`) take ``x`` as llama.cpp's Q8_K blocks of
  256 (a float scale, and the sums of each 16 and 32 values): a 64-value
  chunk's integer dot with its sub-block scales multiplied in by the same
  ``vpmaddubsw`` + ``vpmaddwd`` (the scales in place of ones), the mins
  (Q4_K) and the offset of 32 (Q6_K) one vector product with those sums:
  1.7-1.9x their float GEMVs at ``T`` of 1 (SmolLM2 Q4_K_M's ffn_down,
  one thread's CPU time), GEMVs of 4, 2 and 1 tokens at any ``T`` as the
  32-value types. Q5_K takes float activations. The one-token GEMVs of
  Q8_0, Q5_0 and Q5_1 take two rows a pass with prefetch, as the float ones
  (Q5: 1.1-1.9x a row at a time; Q8_0 1.05-1.17x, measured 0.85-0.96x
  while its scales were on a chain, see :func:`_f16_at`; Q4_0/Q4_1 measured
  0.86-1.18x and stay a row at a time), and the 4-token GEMVs of every q8
  type two rows a pass (1.06-1.14x at ``T`` of 16). From
  ``_Q8_PANEL_TOKENS`` (5) tokens a call, q8 multiplies 32-row byte
  panels instead (:func:`_q8_panel_rows`, the
  float outer product's shape in integers: four inputs of 32 rows are two
  64-byte vectors, each token's four activation bytes broadcast into one
  ``vpdpbusd`` a vector, one float multiply-add a 32-value group):
  SmolLM2's projections on 2 threads 1.4x the float kernels at 8 tokens,
  1.8x at 16, 2.0-2.1x at 136 and 1.8-1.9x at 512, where the GEMVs of 4
  tokens had been 0.9x at 16 and 0.5-0.8x in prefill (they unpack each
  block again for every 4 tokens). A token's q8 result is the same bits
  in any call of fewer than 5 tokens (each row's sums the same sequence in
  every GEMV), and the same bits in any call of 5 or more; the two differ
  in float32 summation order (tested). Its error is
  quantization's, not rounding's: 0.3-1% of a projection's output on
  SmolLM2's activations (whose outliers share a block's scale), 1.1 at
  most in a logit, and greedy decoding leaves transformers' tokens within
  a few steps on 7 of its 8 test prompts (float activations follow all
  64) - where llama.cpp leaves them too: llama-server's tokens are q8's on
  4 prompts to the end, and its first departures from transformers' on
  the first five are at q8's steps.

How the loops are written decides whether LLVM vectorises them, and each
rule below was measured (``inspect_asm``) rather than assumed:

- Dequantizing loops run over a trip count passed in at run time
  (``lanes``, always the format's group of 16 or 32 values), never a
  literal: with a literal LLVM unrolls the loop whole before its loop
  vectoriser sees it, and the SLP vectoriser that gets the unrolled code
  cannot tell the float buffer from the weight bytes, so it stays scalar
  (2.3 GB/s against 9 GB/s).
- Indices inside hot loops are built from ``range`` variables over slices
  taken outside: an index numba cannot prove non-negative gets a
  wraparound select on every access, which blocks SIMD.
- A GEMV's running sums are LLVM vectors spelled out (:func:`_vfloats`
  and its siblings, numba types whose values are ``<16 x float>``): with
  an accumulator array, each block's update waited on the previous one's
  store (6 GB/s, no faster than the buffer), and 32 scalar sums were left
  scalar by the SLP vectoriser (2.4 GB/s); as vectors, a Q8_0 block is
  four ``vpmovsxbd``/``vcvtdq2ps``/``vfmadd`` and nothing else (15 GB/s
  a thread on one 3072 x 576 matrix).
- An f16 scale is one ``vcvtph2ps`` (an LLVM ``fpext`` from ``half``,
  :func:`_f16_at`); converting it with integer bit tricks cost more than
  the 32 values it scales. Its two bytes go through a general register
  (``movzwl``, ``vmovd``): loaded straight into a vector register, LLVM
  wrote them with ``vpinsrw``, which keeps the rest of its target, and
  picked one still holding the last block's scales, so each block's scale
  waited on the one before (the Q8_0 GEMVs ran at half speed with q8
  activations, 0.9x with float ones).
- Sums are float32 with reassociation allowed (``fastmath``), so results
  differ from numpy's matmul in the last bits, as two BLAS libraries do.
  Dequantizing itself is compiled without fastmath: :func:`dequantize_rows`
  equals ``gguf.quants.dequantize`` exactly.

Nothing here needs a particular CPU: numba compiles for the host (AVX2 or
AVX-512), and its on-disk cache is keyed by the host CPU. The q8 dot
product alone names x86 instructions (:func:`_dot_isa` picks them from the
host's features, plain LLVM arithmetic where there are none, or where numba
is told to compile for another CPU). Compiled code is
cached like the attention kernels' (``cache=True``).

Type numbers are GGML's (:class:`GGMLType`), as GGUF files store them.
"""

from __future__ import annotations

import importlib
import operator
import os
import platform
import weakref
from typing import Any

import numpy as np

from structllm.formats.quants import GGMLType
from structllm.model import kernels, vectors

__all__ = [
    "MATMUL_TYPES",
    "Q8K_TYPES",
    "Q8_TYPES",
    "GGMLType",
    "available",
    "block_layout",
    "dequantize_rows",
    "matmul",
    "matmul_call",
    "read_only",
    "row_bytes",
    "warm_up",
]

numba: Any = kernels.numba


#: (values a block, bytes a block), as ``ggml-common.h`` lays them out
_LAYOUTS: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18),  # f16 d, 16 bytes of nibbles
    GGMLType.Q4_1: (32, 20),  # f16 d, f16 m, 16 bytes of nibbles
    GGMLType.Q5_0: (32, 22),  # f16 d, 4 bytes of high bits, 16 of nibbles
    GGMLType.Q5_1: (32, 24),  # f16 d, f16 m, high bits, nibbles
    GGMLType.Q8_0: (32, 34),  # f16 d, 32 int8
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),  # f16 d, f16 dmin, 12 bytes scales, 128 nibbles
    GGMLType.Q5_K: (256, 176),  # as Q4_K, then 32 bytes of high bits
    GGMLType.Q6_K: (256, 210),  # 128 ql, 64 qh, 16 int8 scales, f16 d
}

#: types :func:`matmul` and :func:`dequantize_rows` read
MATMUL_TYPES = frozenset(
    {
        GGMLType.F32,
        GGMLType.F16,
        GGMLType.BF16,
        GGMLType.Q4_0,
        GGMLType.Q4_1,
        GGMLType.Q5_0,
        GGMLType.Q5_1,
        GGMLType.Q8_0,
        GGMLType.Q4_K,
        GGMLType.Q5_K,
        GGMLType.Q6_K,
    }
)


def available() -> bool:
    """Whether the compiled kernels can run (numba imported)."""
    return numba is not None


def block_layout(qtype: int) -> tuple[int, int]:
    """``(values_per_block, bytes_per_block)`` of a GGML type."""
    try:
        return _LAYOUTS[GGMLType(qtype)]
    except (ValueError, KeyError):
        raise ValueError(
            f"qtype {qtype!r} is not a GGML type this module knows"
        ) from None


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row of ``in_features`` values of type ``qtype``."""
    values, size = block_layout(qtype)
    if in_features <= 0 or in_features % values:
        raise ValueError(
            f"in_features {in_features} is not a positive multiple of"
            f" {GGMLType(qtype).name}'s {values} values a block"
        )
    return in_features // values * size


# -- compiled helpers ---------------------------------------------------------


def _f16_at(row: np.ndarray, index: int) -> float:  # pragma: no cover
    """The IEEE half at bytes ``row[index:index + 2]`` as float32 (compiled
    code: one ``vcvtph2ps`` through LLVM's ``fpext``)."""
    return float(row[index : index + 2].view(np.float16)[0])


def _f16_at_intrinsic(typingctx: Any, row: Any, index: Any) -> Any:
    ir = importlib.import_module("llvmlite.ir")

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array = context.make_array(signature.args[0])(context, builder, args[0])
        address = builder.gep(array.data, [args[1]])
        bits = builder.load(
            builder.bitcast(address, ir.IntType(16).as_pointer()), align=1
        )
        # an empty asm the value passes through, so that the load cannot
        # fold into a vpinsrw (see the module's notes): a general register,
        # then vmovd, which writes its whole target
        i32 = ir.IntType(32)
        wide = builder.asm(
            ir.FunctionType(i32, [i32]), "", "=r,0", [builder.zext(bits, i32)], False
        )
        bits = builder.trunc(wide, ir.IntType(16))
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())

    return numba.types.float32(row, index), codegen


if numba is not None:
    _f16_at = numba.extending.intrinsic(_f16_at_intrinsic)

# -- 16-lane vectors for the batch-1 kernels ----------------------------------
#
# The GEMV kernels hold their running sums in registers across a whole row,
# in the float and int32 vectors of ``vectors`` (one type for every kernel
# module; see there why the kernels spell their vectors out). What only
# these kernels need is added here: a Q5 block's fifth bits, the panels'
# 16 x 16 transposes, and (below) the byte vectors of q8 activations.

#: lanes of a vector
_VLANES = vectors.LANES
_vzero = vectors.vzero
_vsplat = vectors.vsplat
_vfloats = vectors.vfloats
_vbytes = vectors.vbytes
_vint8s = vectors.vint8s
_vhalves = vectors.vhalves
_vbf16s = vectors.vbf16s
_vfloat = vectors.vfloat
_vsum = vectors.vsum
_vstore = vectors.vstore
_prefetch = vectors.prefetch


def _vaddbits(
    v: Any, row: np.ndarray, index: int, if_set: float, if_clear: float
) -> Any:  # pragma: no cover - compiled
    """``v`` plus ``if_set`` in lane ``i`` where bit ``i`` of the 16 bits at
    bytes ``row[index:index + 2]`` (little-endian) is set, plus ``if_clear``
    where it is not: a Q5 block's fifth bits on its values as floats. With
    constants, one ``kmovw`` and a masked add or subtract on AVX-512, where
    shifting each lane's bit out took four operations."""


def _vtranspose16(
    src: np.ndarray, at: int, stride: int, dst: np.ndarray, to: int, step: int
) -> None:  # pragma: no cover - compiled
    """Write the 16 x 16 float32 block of ``src`` whose rows start at
    ``src.flat[at + i * stride]`` into ``dst`` transposed: its column ``j``
    is ``dst.flat[to + j * step:][:16]``. 16 loads, 4 rounds of 16
    shuffles (each swapping the off-diagonal sub-blocks of a size), 16
    stores."""


def _define_vectors() -> None:
    """Register the fifth bits' and the transposes' intrinsics with numba."""
    ir = importlib.import_module("llvmlite.ir")
    types = numba.types
    extending = numba.extending
    i16, i32, f32 = ir.IntType(16), ir.IntType(32), ir.FloatType()
    vf32, vi32 = ir.VectorType(f32, _VLANES), ir.VectorType(i32, _VLANES)
    fvec = vectors.FLOAT

    def add_bits(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        array = context.make_array(sig.args[1])(context, builder, args[1])
        address = builder.bitcast(builder.gep(array.data, [args[2]]), i16.as_pointer())
        mask = builder.bitcast(
            builder.load(address, align=1), ir.VectorType(ir.IntType(1), _VLANES)
        )
        sums = []
        for k in (3, 4):  # if set, if clear
            amount = context.cast(builder, args[k], sig.args[k], types.float32)
            total = builder.fadd(
                args[0], vectors.splat(builder, amount, vf32), flags=("fast",)
            )
            sums.append(total)
        return builder.select(mask, *sums)

    def add_bits_typer(
        typingctx: Any, v: Any, row: Any, index: Any, if_set: Any, if_clear: Any
    ) -> Any:
        return fvec(v, row, index, if_set, if_clear), add_bits

    g = globals()
    g["_vaddbits"] = extending.intrinsic(add_bits_typer)

    def transpose(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        src = context.make_array(sig.args[0])(context, builder, args[0])
        dst = context.make_array(sig.args[3])(context, builder, args[3])

        def row(array: Any, start: Any, stride: Any, i: int) -> Any:
            index = builder.add(start, builder.mul(stride, ir.Constant(stride.type, i)))
            address = builder.gep(array.data, [index])
            return builder.bitcast(address, vf32.as_pointer())

        rows = [builder.load(row(src, args[1], args[2], i), align=4) for i in range(16)]
        size = 8
        while size:  # swap the off-diagonal size x size blocks
            low = [j + 16 - size if j & size else j for j in range(16)]
            high = [j + 16 if j & size else j + size for j in range(16)]
            for i in range(16):
                if not i & size:
                    a, b = rows[i], rows[i + size]
                    rows[i] = builder.shuffle_vector(a, b, ir.Constant(vi32, low))
                    rows[i + size] = builder.shuffle_vector(
                        a, b, ir.Constant(vi32, high)
                    )
            size //= 2
        for i in range(16):
            builder.store(rows[i], row(dst, args[4], args[5], i), align=4)
        return context.get_dummy_value()

    def transpose_typer(
        typingctx: Any, src: Any, at: Any, stride: Any, dst: Any, to: Any, step: Any
    ) -> Any:
        return types.none(src, at, stride, dst, to, step), transpose

    g["_vtranspose16"] = extending.intrinsic(transpose_typer)


# -- 64 bytes at a time: the q8 activation kernels -----------------------------
#
# With ``activations="q8"`` a block's products are integers: 64 weight bytes
# (two 32-value blocks, unpacked to one byte a value) against 64 int8
# activations, four products summed into each of 16 int32 lanes by
# :func:`_vdot`: one ``vpdpbusd`` with AVX-512 VNNI, ``vpmaddubsw`` +
# ``vpmaddwd`` on AVX-512BW or (in two halves) AVX2, and plain LLVM
# multiplies and adds elsewhere (each chosen when the kernels compile, for
# the host numba compiles for).


def _bq8x2(row: np.ndarray, a: int, b: int) -> Any:  # pragma: no cover
    """The 32 int8 at ``row[a:]`` then the 32 at ``row[b:]``, as 64 bytes."""


def _bnib2(row: np.ndarray, a: int, b: int) -> Any:  # pragma: no cover
    """Two Q4 blocks' 16 bytes at ``row[a:]`` and ``row[b:]`` as 64 values
    0..15 in value order: low nibbles, high nibbles, each block's."""


def _bhigh2(row: np.ndarray, a: int, b: int) -> Any:  # pragma: no cover
    """Two Q5 blocks' fifth bits (a little-endian uint32 at ``row[a:]`` and
    at ``row[b:]``, bit j value j's) as 64 bytes of 0 or 16."""


def _bint8s(a: np.ndarray, index: int) -> Any:  # pragma: no cover
    """The 64 int8 ``a[index:index + 64]``."""


def _vints(a: np.ndarray, index: int) -> Any:  # pragma: no cover
    """The 16 int32 ``a[index:index + 16]``."""


def _vsplat2(a: Any, b: Any) -> Any:  # pragma: no cover
    """The float vector of ``a`` in lanes 0..7 and ``b`` in lanes 8..15."""


def _vdot(u: Any, s: Any) -> Any:  # pragma: no cover
    """Lane i of the int32 result: ``sum(u[4i + k] * s[4i + k], k < 4)`` for
    ``u`` unsigned and ``s`` signed bytes (``vpdpbusd``). Exact where
    ``vpmaddubsw`` would not saturate: each pair's sum within int16 (``u``
    at most 128 against ``s`` in -127..127)."""


def _vdots(w: Any, s: Any) -> Any:  # pragma: no cover
    """:func:`_vdot` of two signed byte vectors (``s`` in -127..127): ``|w|``
    against ``s`` with ``w``'s sign, as llama.cpp's AVX2 kernels do."""


def _bnib32(row: np.ndarray, a: int) -> Any:  # pragma: no cover
    """The 32 bytes at ``row[a:]`` as 64 values 0..15: their low nibbles,
    then their high nibbles (two Q4_K sub-blocks)."""


def _bq6(row: np.ndarray, ql: int, qh: int, i: int) -> Any:  # pragma: no cover
    """64 Q6_K values 0..63: nibble ``i`` of the 64 bytes at ``row[ql:]``
    with, as bits 4 and 5, bits ``4 i``/``4 i + 1`` (values 0..31) and ``4 i
    + 2``/``4 i + 3`` (values 32..63) of the 32 bytes at ``row[qh:]``."""


def _vbytes8(lo: int, hi: int) -> Any:  # pragma: no cover
    """The int32 vector of the 8 bytes of two uint32 (``lo``'s first, each
    little-endian) in lanes 0..7, zeros in 8..15."""


def _vspread(v: Any, group: int, c: int) -> Any:  # pragma: no cover
    """The int32 vector whose lane i is ``v[16 // group * c + i // group]``
    (``group`` and ``c`` literal constants): a chunk's scales spread over
    the lanes of the dot products they scale."""


def _vdotsc(u: Any, s: Any, scales: Any) -> Any:  # pragma: no cover
    """:func:`_vdot` with lane i times ``scales[i]`` (an int32 vector of
    int16 values): ``vpmaddubsw`` then ``vpmaddwd`` against the scales
    rather than ones, so the scaling is free. Exact where each pair of
    products fits int16 (``u`` at most 63 against ``s`` in -127..127)."""


def _bsplat4(a: np.ndarray, index: int) -> Any:  # pragma: no cover
    """The 4 bytes ``a[index:index + 4]`` repeated 16 times (64 bytes)."""


def _bflip(v: Any) -> Any:  # pragma: no cover
    """Signed bytes as unsigned, plus 128 (their top bits flipped)."""


def _bstore(a: np.ndarray, index: int, v: Any) -> None:  # pragma: no cover
    """Write 64 bytes to ``a[index:index + 64]`` (a byte array)."""


def _vdotacc(acc: Any, u: Any, s: Any) -> Any:  # pragma: no cover
    """``acc + _vdot(u, s)``: one ``vpdpbusd`` into ``acc`` with VNNI."""


def _vabsmax2(a: Any, b: Any) -> Any:  # pragma: no cover
    """The largest magnitude among two float vectors' lanes (a float32)."""


def _vround(v: Any, scale: Any) -> Any:  # pragma: no cover
    """``np.rint(v * scale)`` lane by lane (float32, half to even) as int32:
    the multiply IEEE's, not fast-math's."""


def _vstore8(a: np.ndarray, index: int, v: Any) -> None:  # pragma: no cover
    """Write an int32 vector's lanes, truncated to bytes, to ``a[index:][:16]``."""


def _visum(v: Any) -> int:  # pragma: no cover
    """The sum of an int32 vector's lanes."""
    return 0


def _vfma(a: Any, b: Any, c: Any) -> Any:  # pragma: no cover
    """``a * b + c`` rounded once (``llvm.fma``): a float vector sum whose
    order the fast-math flags of ``+`` and ``*`` cannot change."""


def _f16_round(v: Any) -> float:  # pragma: no cover
    """``v`` rounded to the nearest IEEE half (ties to even), as float32."""
    return float(np.float32(np.float16(v)))


def _dot_isa() -> str:
    """The instructions :func:`_vdot` compiles to: ``vnni``, ``avx512bw``,
    ``avx2`` or ``generic``. ``STRUCTLLM_QK_DOT`` forces one (tests; give
    numba its own cache directory then: the choice is compiled in)."""
    forced = os.environ.get("STRUCTLLM_QK_DOT")
    if forced:
        return forced
    config = numba.config
    if config.CPU_NAME or config.CPU_FEATURES:  # not compiled for this host
        return "generic"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    features = importlib.import_module("llvmlite.binding").get_host_cpu_features()
    if features.get("avx512vnni") and features.get("avx512bw"):
        return "vnni"
    if features.get("avx512bw"):
        return "avx512bw"
    if features.get("avx2"):
        return "avx2"
    return "generic"


def _define_byte_vectors(fvec: Any, ivec: Any) -> None:
    """Register the 64-byte vector type and the q8 kernels' intrinsics."""
    ir = importlib.import_module("llvmlite.ir")
    cgutils = importlib.import_module("numba.core.cgutils")
    types = numba.types
    extending = numba.extending
    i1, i8, i16, i32, i64 = (ir.IntType(k) for k in (1, 8, 16, 32, 64))
    f32 = ir.FloatType()
    vb64, vi32 = ir.VectorType(i8, 64), ir.VectorType(i32, _VLANES)
    vf32 = ir.VectorType(f32, _VLANES)
    isa = _dot_isa()

    def init(self: Any, dmm: Any, fe_type: Any) -> None:
        extending.models.PrimitiveModel.__init__(self, dmm, fe_type, vb64)

    kind = vectors.module_class("ByteVector64", types.Type, __name__)
    base = extending.models.PrimitiveModel
    model = type("ByteVector64Model", (base,), {"__init__": init})
    extending.register_model(kind)(model)
    bvec = kind(name="ByteVector64")

    def address(context: Any, builder: Any, sig: Any, args: Any, at: int) -> Any:
        array = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.gep(array.data, [args[at]])

    def load(builder: Any, pointer: Any, ty: Any) -> Any:
        return builder.load(builder.bitcast(pointer, ty.as_pointer()), align=1)

    def const(ty: Any, values: Any) -> Any:
        return ir.Constant(ty, list(values))

    def shuffle(builder: Any, a: Any, b: Any, mask: Any) -> Any:
        return builder.shuffle_vector(a, b, const(ir.VectorType(i32, len(mask)), mask))

    def q8x2(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ty = ir.VectorType(i8, 32)
        a = load(builder, address(context, builder, sig, args, 1), ty)
        b = load(builder, address(context, builder, sig, args, 2), ty)
        return shuffle(builder, a, b, range(64))

    def nib2(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ty = ir.VectorType(i8, 16)
        a = load(builder, address(context, builder, sig, args, 1), ty)
        b = load(builder, address(context, builder, sig, args, 2), ty)
        v = shuffle(builder, a, b, range(32))
        v32 = ir.VectorType(i8, 32)
        lo = builder.and_(v, const(v32, [15] * 32))
        hi = builder.lshr(v, const(v32, [4] * 32))
        mask = [*range(16), *range(32, 48), *range(16, 32), *range(48, 64)]
        return shuffle(builder, lo, hi, mask)

    def high2(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        a = load(builder, address(context, builder, sig, args, 1), i32)
        b = load(builder, address(context, builder, sig, args, 2), i32)
        bits = builder.or_(
            builder.zext(a, i64),
            builder.shl(builder.zext(b, i64), ir.Constant(i64, 32)),
        )
        flags = builder.bitcast(bits, ir.VectorType(i1, 64))
        return builder.shl(builder.zext(flags, vb64), const(vb64, [4] * 64))

    def int8s(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return load(builder, address(context, builder, sig, args, 1), vb64)

    def ints(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return load(builder, address(context, builder, sig, args, 1), vi32)

    def splat2(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        a = context.cast(builder, args[0], sig.args[0], types.float32)
        b = context.cast(builder, args[1], sig.args[1], types.float32)
        undef = ir.Constant(vf32, ir.Undefined)
        v = builder.insert_element(undef, a, ir.Constant(i32, 0))
        v = builder.insert_element(v, b, ir.Constant(i32, 1))
        return shuffle(builder, v, undef, [0] * 8 + [1] * 8)

    def call(builder: Any, name: str, result: Any, *operands: Any) -> Any:
        fnty = ir.FunctionType(result, [o.type for o in operands])
        fn = cgutils.get_or_insert_function(builder.module, fnty, name)
        return builder.call(fn, list(operands))

    def dot(builder: Any, u: Any, s: Any) -> Any:
        if isa == "vnni":
            zero = ir.Constant(vi32, [0] * _VLANES)
            return call(
                builder,
                "llvm.x86.avx512.vpdpbusd.512",
                vi32,
                zero,
                builder.bitcast(u, vi32),
                builder.bitcast(s, vi32),
            )
        if isa == "avx512bw":
            pairs = call(
                builder, "llvm.x86.avx512.pmaddubs.w.512", ir.VectorType(i16, 32), u, s
            )
            ones = ir.Constant(ir.VectorType(i16, 32), [1] * 32)
            return call(builder, "llvm.x86.avx512.pmaddw.d.512", vi32, pairs, ones)
        if isa == "avx2":
            halves = []
            ones = ir.Constant(ir.VectorType(i16, 16), [1] * 16)
            for h in range(2):
                part = range(32 * h, 32 * h + 32)
                pairs = call(
                    builder,
                    "llvm.x86.avx2.pmadd.ub.sw",
                    ir.VectorType(i16, 16),
                    shuffle(builder, u, u, part),
                    shuffle(builder, s, s, part),
                )
                halves.append(
                    call(
                        builder,
                        "llvm.x86.avx2.pmadd.wd",
                        ir.VectorType(i32, 8),
                        pairs,
                        ones,
                    )
                )
            return shuffle(builder, halves[0], halves[1], range(16))
        wide = ir.VectorType(i32, 64)
        products = builder.mul(builder.zext(u, wide), builder.sext(s, wide))
        total = None
        for k in range(4):
            part = shuffle(builder, products, products, range(k, 64, 4))
            total = part if total is None else builder.add(total, part)
        return total

    def dot_us(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return dot(builder, args[0], args[1])

    def dot_scaled(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        u, s, scales = args
        v16 = ir.VectorType(i16, _VLANES)
        narrow = builder.trunc(scales, v16)
        if isa in ("vnni", "avx512bw"):
            pairs = call(
                builder, "llvm.x86.avx512.pmaddubs.w.512", ir.VectorType(i16, 32), u, s
            )
            wide = shuffle(builder, narrow, narrow, [i // 2 for i in range(32)])
            return call(builder, "llvm.x86.avx512.pmaddw.d.512", vi32, pairs, wide)
        if isa == "avx2":
            halves = []
            for h in range(2):
                part = range(32 * h, 32 * h + 32)
                pairs = call(
                    builder,
                    "llvm.x86.avx2.pmadd.ub.sw",
                    ir.VectorType(i16, 16),
                    shuffle(builder, u, u, part),
                    shuffle(builder, s, s, part),
                )
                lanes = [8 * h + i // 2 for i in range(16)]
                halves.append(
                    call(
                        builder,
                        "llvm.x86.avx2.pmadd.wd",
                        ir.VectorType(i32, 8),
                        pairs,
                        shuffle(builder, narrow, narrow, lanes),
                    )
                )
            return shuffle(builder, halves[0], halves[1], range(16))
        return builder.mul(dot(builder, u, s), scales)

    def nib32(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        v = load(
            builder, address(context, builder, sig, args, 1), ir.VectorType(i8, 32)
        )
        v32 = ir.VectorType(i8, 32)
        lo = builder.and_(v, const(v32, [15] * 32))
        hi = builder.lshr(v, const(v32, [4] * 32))
        return shuffle(builder, lo, hi, range(64))

    def q6(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        low = load(builder, address(context, builder, sig, args, 1), vb64)
        high = load(
            builder, address(context, builder, sig, args, 2), ir.VectorType(i8, 32)
        )
        shift = builder.trunc(
            builder.shl(args[3], ir.Constant(args[3].type, 2)), i8
        )  # 4 i
        undef = ir.Constant(vb64, ir.Undefined)
        by = builder.insert_element(undef, shift, ir.Constant(i32, 0))
        by = builder.shuffle_vector(by, undef, const(ir.VectorType(i32, 64), [0] * 64))
        twice = shuffle(builder, high, high, range(64))
        # values 32..63 take the next two bits
        steps = builder.add(by, const(vb64, [0] * 32 + [2] * 32))
        bits = builder.and_(builder.lshr(twice, steps), const(vb64, [3] * 64))
        nibble = builder.and_(builder.lshr(low, by), const(vb64, [15] * 64))
        return builder.or_(nibble, builder.shl(bits, const(vb64, [4] * 64)))

    def bytes8(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        lo = builder.trunc(args[0], i32) if args[0].type.width > 32 else args[0]
        hi = builder.trunc(args[1], i32) if args[1].type.width > 32 else args[1]
        bits = builder.or_(
            builder.zext(lo, i64),
            builder.shl(builder.zext(hi, i64), ir.Constant(i64, 32)),
        )
        eight = builder.zext(
            builder.bitcast(bits, ir.VectorType(i8, 8)), ir.VectorType(i32, 8)
        )
        zeros = ir.Constant(ir.VectorType(i32, 8), [0] * 8)
        return shuffle(builder, eight, zeros, range(16))

    def spread_typer(typingctx: Any, v: Any, group: Any, c: Any) -> Any:
        if not (
            isinstance(group, types.IntegerLiteral)
            and isinstance(c, types.IntegerLiteral)
        ):
            return None
        g, k = group.literal_value, c.literal_value
        lanes = [_VLANES // g * k + i // g for i in range(_VLANES)]

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return shuffle(builder, args[0], args[0], lanes)

        return ivec(v, group, c), codegen

    def dot_ss(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        w, s = args
        absolute = call(builder, "llvm.abs.v64i8", vb64, w, ir.Constant(i1, 0))
        negative = builder.icmp_signed("<", w, ir.Constant(vb64, [0] * 64))
        signed = builder.select(
            negative, builder.sub(ir.Constant(vb64, [0] * 64), s), s
        )
        return dot(builder, absolute, signed)

    def splat4(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        word = load(builder, address(context, builder, sig, args, 1), i32)
        undef = ir.Constant(vi32, ir.Undefined)
        one = builder.insert_element(undef, word, ir.Constant(i32, 0))
        zeros = ir.Constant(vi32, [0] * _VLANES)
        return builder.bitcast(builder.shuffle_vector(one, undef, zeros), vb64)

    def flip(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.xor(args[0], const(vb64, [-128] * 64))

    def store(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        pointer = address(context, builder, sig, args, 1)
        builder.store(args[2], builder.bitcast(pointer, vb64.as_pointer()), align=1)
        return context.get_dummy_value()

    def dot_acc(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        acc, u, s = args
        if isa == "vnni":
            return call(
                builder,
                "llvm.x86.avx512.vpdpbusd.512",
                vi32,
                acc,
                builder.bitcast(u, vi32),
                builder.bitcast(s, vi32),
            )
        return builder.add(acc, dot(builder, u, s))

    def absmax2(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        # as integers: a magnitude's bits order as its value, and an
        # integer maximum has no NaN rules to lower (the float reduction's
        # compare-and-blend sequence was most of a block's time)
        sign = const(vi32, [0x7FFFFFFF] * _VLANES)
        a, b = (builder.and_(builder.bitcast(v, vi32), sign) for v in args)
        top = call(builder, "llvm.umax.v16i32", vi32, a, b)
        bits = call(builder, "llvm.vector.reduce.umax.v16i32", i32, top)
        return builder.bitcast(bits, f32)

    def round_(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        scale = context.cast(builder, args[1], sig.args[1], types.float32)
        undef = ir.Constant(vf32, ir.Undefined)
        one = builder.insert_element(undef, scale, ir.Constant(i32, 0))
        splat = builder.shuffle_vector(one, undef, const(vi32, [0] * _VLANES))
        product = builder.fmul(args[0], splat)
        return builder.fptosi(call(builder, "llvm.rint.v16f32", vf32, product), vi32)

    def store8(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        pointer = address(context, builder, sig, args, 1)
        narrow = builder.trunc(args[2], ir.VectorType(i8, _VLANES))
        builder.store(
            narrow, builder.bitcast(pointer, narrow.type.as_pointer()), align=1
        )
        return context.get_dummy_value()

    def isum(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return call(builder, "llvm.vector.reduce.add.v16i32", i32, args[0])

    def fma(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return call(builder, "llvm.fma.v16f32", vf32, *args)

    def f16_round(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.fpext(builder.fptrunc(v, ir.HalfType()), f32)

    typed = vectors.intrinsic

    g = globals()
    g["_bq8x2"] = typed(bvec, q8x2, 3)
    g["_bnib2"] = typed(bvec, nib2, 3)
    g["_bhigh2"] = typed(bvec, high2, 3)
    g["_bint8s"] = typed(bvec, int8s, 2)
    g["_vints"] = typed(ivec, ints, 2)
    g["_vsplat2"] = typed(fvec, splat2, 2)
    g["_vdot"] = typed(ivec, dot_us, 2)
    g["_vdots"] = typed(ivec, dot_ss, 2)
    g["_f16_round"] = typed(types.float32, f16_round, 1)
    g["_bnib32"] = typed(bvec, nib32, 2)
    g["_bq6"] = typed(bvec, q6, 4)
    g["_vbytes8"] = typed(ivec, bytes8, 2)
    g["_vspread"] = extending.intrinsic(prefer_literal=True)(spread_typer)
    g["_vdotsc"] = typed(ivec, dot_scaled, 3)
    g["_bsplat4"] = typed(bvec, splat4, 2)
    g["_bflip"] = typed(bvec, flip, 1)
    g["_bstore"] = typed(types.none, store, 3)
    g["_vdotacc"] = typed(ivec, dot_acc, 3)
    g["_vfma"] = typed(fvec, fma, 3)
    g["_vabsmax2"] = typed(types.float32, absmax2, 2)
    g["_vround"] = typed(ivec, round_, 2)
    g["_vstore8"] = typed(types.none, store8, 3)
    g["_visum"] = typed(types.int32, isum, 1)

    implement = typed(bvec, lambda c, b, sig, args: b.or_(*args), 2)

    def bor(a: Any, b: Any) -> Any:
        if a is not bvec or b is not bvec:
            return None

        def apply(a: Any, b: Any) -> Any:
            return implement(a, b)

        return apply

    extending.overload(operator.or_)(bor)


if numba is not None:
    _define_vectors()
    _define_byte_vectors(vectors.FLOAT, vectors.INT)


_jit = kernels._jit
_prange = kernels._prange

#: exact float32 arithmetic (no fused multiply-add): the dequantizers
_EXACT = False


@_jit(fastmath=_EXACT)
def _u32_at(row: np.ndarray, index: int) -> Any:  # pragma: no cover - compiled
    return (
        np.uint32(row[index])
        | (np.uint32(row[index + 1]) << 8)
        | (np.uint32(row[index + 2]) << 16)
        | (np.uint32(row[index + 3]) << 24)
    )


# Each _dq_* writes blocks b0..b1-1 of one row (its bytes, ``row``) into
# ``dst[0 : (b1 - b0) * values_per_block]``, in the order and with the float32
# arithmetic of gguf-py's dequantize_blocks (llama.cpp's dequantize_row_*).


@_jit(fastmath=_EXACT)
def _dq_f32(
    row: np.ndarray, b0: int, b1: int, dst: np.ndarray, lanes: int
) -> None:  # pragma: no cover
    src = row[b0 * 4 : b1 * 4]
    for i in range(b1 - b0):
        dst[i] = np.uint32(_u32_at(src, 4 * i)).view(np.float32)


@_jit(fastmath=_EXACT)
def _dq_f16(
    row: np.ndarray, b0: int, b1: int, dst: np.ndarray, lanes: int
) -> None:  # pragma: no cover
    src = row[b0 * 2 : b1 * 2]
    for i in range(b1 - b0):
        dst[i] = _f16_at(src, 2 * i)


@_jit(fastmath=_EXACT)
def _dq_bf16(
    row: np.ndarray, b0: int, b1: int, dst: np.ndarray, lanes: int
) -> None:  # pragma: no cover
    src = row[b0 * 2 : b1 * 2]
    for i in range(b1 - b0):
        bits = (np.uint32(src[2 * i]) << 16) | (np.uint32(src[2 * i + 1]) << 24)
        dst[i] = np.uint32(bits).view(np.float32)


@_jit(fastmath=_EXACT)
def _dq_q8_0(
    row: np.ndarray, b0: int, b1: int, dst: np.ndarray, lanes: int
) -> None:  # pragma: no cover
    src = row[b0 * 34 : b1 * 34]
    for b in range(b1 - b0):
        d = _f16_at(src, 34 * b)
        for j in range(lanes):  # 32
            dst[32 * b + j] = np.float32(np.int8(src[34 * b + 2 + j])) * d


@_jit(fastmath=_EXACT)
def _dq_q4_0(
    row: np.ndarray, b0: int, b1: int, dst: np.ndarray, lanes: int
) -> None:  # pragma: no cover
    src = row[b0 * 18 : b1 * 18]
    half = lanes // 2
    for b in range(b1 - b0):
        d = _f16_at(src, 18 * b)
        for j in range(half):  # 16: low nibbles are values 0..15, high 16..31
            q = src[18 * b + 2 + j]
            dst[32 * b + j] = d * np.float32(np.int32(q & 15) - 8)
            dst[32 * b + 16 + j] = d * np.float32(np.int32(q >> 4) - 8)


@_jit(fastmath=_EXACT)
def _dq_q4_1(
    row: np.ndarray, b0: int, b1: int, dst: np.ndarray, lanes: int
) -> None:  # pragma: no cover
    src = row[b0 * 20 : b1 * 20]
    half = lanes // 2
    for b in range(b1 - b0):
        d = _f16_at(src, 20 * b)
        m = _f16_at(src, 20 * b + 2)
        for j in range(half):
            q = src[20 * b + 4 + j]
            dst[32 * b + j] = d * np.float32(q & 15) + m
            dst[32 * b + 16 + j] = d * np.float32(q >> 4) + m


@_jit(fastmath=_EXACT)
def _dq_q5_0(
    row: np.ndarray, b0: int, b1: int, dst: np.ndarray, lanes: int
) -> None:  # pragma: no cover
    src = row[b0 * 22 : b1 * 22]
    half = lanes // 2
    for b in range(b1 - b0):
        d = _f16_at(src, 22 * b)
        qh = _u32_at(src, 22 * b + 2)  # bit j: the fifth bit of value j
        for j in range(half):
            q = src[22 * b + 6 + j]
            lo = np.int32(q & 15) | np.int32(((qh >> j) & 1) << 4)
            hi = np.int32(q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            dst[32 * b + j] = d * np.float32(lo - 16)
            dst[32 * b + 16 + j] = d * np.float32(hi - 16)


@_jit(fastmath=_EXACT)
def _dq_q5_1(
    row: np.ndarray, b0: int, b1: int, dst: np.ndarray, lanes: int
) -> None:  # pragma: no cover
    src = row[b0 * 24 : b1 * 24]
    half = lanes // 2
    for b in range(b1 - b0):
        d = _f16_at(src, 24 * b)
        m = _f16_at(src, 24 * b + 2)
        qh = _u32_at(src, 24 * b + 4)
        for j in range(half):
            q = src[24 * b + 8 + j]
            lo = np.uint32(q & 15) | (((qh >> j) & 1) << 4)
            hi = np.uint32(q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            dst[32 * b + j] = d * np.float32(lo) + m
            dst[32 * b + 16 + j] = d * np.float32(hi) + m


@_jit(fastmath=_EXACT)
def _scale_min_k4(j: int, scales: np.ndarray) -> Any:  # pragma: no cover
    """Sub-block ``j``'s 6-bit scale and min from Q4_K/Q5_K's 12 bytes."""
    if j < 4:
        return np.int32(scales[j] & 63), np.int32(scales[j + 4] & 63)
    sc = (scales[j + 4] & 15) | ((scales[j - 4] >> 6) << 4)
    m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)
    return np.int32(sc), np.int32(m)


@_jit(fastmath=_EXACT)
def _dq_q4_k(
    row: np.ndarray, b0: int, b1: int, dst: np.ndarray, lanes: int
) -> None:  # pragma: no cover
    src = row[b0 * 144 : b1 * 144]
    for b in range(b1 - b0):
        o = 144 * b
        d = _f16_at(src, o)
        dmin = _f16_at(src, o + 2)
        scales = src[o + 4 : o + 16]
        for p in range(4):  # 64 values: 32 low nibbles, then 32 high
            qs = o + 16 + 32 * p
            e = 256 * b + 64 * p
            sc, m = _scale_min_k4(2 * p, scales)
            d1, m1 = d * np.float32(sc), dmin * np.float32(m)
            sc, m = _scale_min_k4(2 * p + 1, scales)
            d2, m2 = d * np.float32(sc), dmin * np.float32(m)
            for j in range(lanes):  # 32
                dst[e + j] = d1 * np.float32(src[qs + j] & 15) - m1
            for j in range(lanes):
                dst[e + 32 + j] = d2 * np.float32(src[qs + j] >> 4) - m2


@_jit(fastmath=_EXACT)
def _dq_q5_k(
    row: np.ndarray, b0: int, b1: int, dst: np.ndarray, lanes: int
) -> None:  # pragma: no cover
    src = row[b0 * 176 : b1 * 176]
    for b in range(b1 - b0):
        o = 176 * b
        d = _f16_at(src, o)
        dmin = _f16_at(src, o + 2)
        scales = src[o + 4 : o + 16]
        qh = o + 16  # bit i of byte j: the fifth bit of value 32 i + j
        for p in range(4):
            qs = o + 48 + 32 * p
            e = 256 * b + 64 * p
            sc, m = _scale_min_k4(2 * p, scales)
            d1, m1 = d * np.float32(sc), dmin * np.float32(m)
            sc, m = _scale_min_k4(2 * p + 1, scales)
            d2, m2 = d * np.float32(sc), dmin * np.float32(m)
            s1, s2 = 2 * p, 2 * p + 1
            for j in range(lanes):  # 32
                q = (src[qs + j] & 15) | (((src[qh + j] >> s1) & 1) << 4)
                dst[e + j] = d1 * np.float32(q) - m1
            for j in range(lanes):
                q = (src[qs + j] >> 4) | (((src[qh + j] >> s2) & 1) << 4)
                dst[e + 32 + j] = d2 * np.float32(q) - m2


@_jit(fastmath=_EXACT)
def _dq_q6_k(
    row: np.ndarray, b0: int, b1: int, dst: np.ndarray, lanes: int
) -> None:  # pragma: no cover
    src = row[b0 * 210 : b1 * 210]
    half = lanes // 2
    for b in range(b1 - b0):
        o = 210 * b
        d = _f16_at(src, o + 208)
        for h in range(2):  # two halves of 128 values
            for k in range(4):  # 32 values: ql nibble k // 2, qh bits 2 k
                ql = o + 64 * h + 32 * (k % 2)
                qh = o + 128 + 32 * h
                shift = 4 * (k // 2)
                for g in range(2):  # 16 values share a scale
                    e = 128 * h + 32 * k + 16 * g
                    scale = d * np.float32(np.int8(src[o + 192 + e // 16]))
                    for j in range(half):  # 16
                        low = (src[ql + 16 * g + j] >> shift) & 15
                        high = (src[qh + 16 * g + j] >> (2 * k)) & 3
                        q = np.int32(low) | np.int32(high << 4)
                        dst[256 * b + e + j] = scale * np.float32(q - 32)


@_jit(fastmath=_EXACT)
def _dequantize_blocks(
    qtype: int, row: np.ndarray, b0: int, b1: int, dst: np.ndarray, lanes: int
) -> None:  # pragma: no cover - compiled
    """Blocks ``b0..b1-1`` of ``row`` (a row's bytes) into ``dst``."""
    if qtype == 8:
        _dq_q8_0(row, b0, b1, dst, lanes)
    elif qtype == 2:
        _dq_q4_0(row, b0, b1, dst, lanes)
    elif qtype == 3:
        _dq_q4_1(row, b0, b1, dst, lanes)
    elif qtype == 12:
        _dq_q4_k(row, b0, b1, dst, lanes)
    elif qtype == 14:
        _dq_q6_k(row, b0, b1, dst, lanes)
    elif qtype == 13:
        _dq_q5_k(row, b0, b1, dst, lanes)
    elif qtype == 6:
        _dq_q5_0(row, b0, b1, dst, lanes)
    elif qtype == 7:
        _dq_q5_1(row, b0, b1, dst, lanes)
    elif qtype == 1:
        _dq_f16(row, b0, b1, dst, lanes)
    elif qtype == 30:
        _dq_bf16(row, b0, b1, dst, lanes)
    else:
        _dq_f32(row, b0, b1, dst, lanes)


@_jit(fastmath=_EXACT)
def _dequantize_rows(
    w: np.ndarray,  # (rows, row_bytes) uint8
    qtype: int,
    values: int,  # a block's
    out: np.ndarray,  # (rows, in) float32
    lanes: int,
) -> None:  # pragma: no cover - compiled
    nb = out.shape[1] // values
    for r in range(w.shape[0]):
        _dequantize_blocks(qtype, w[r], 0, nb, out[r], lanes)


@_jit(fastmath=_EXACT)
def _dequantize_quad(
    qtype: int,
    w: np.ndarray,  # (out_features, row_bytes)
    r0: int,
    nrows: int,
    b0: int,
    b1: int,
    buf: np.ndarray,  # (4, >= values in b0..b1-1)
    lanes: int,
) -> None:  # pragma: no cover - compiled
    """Blocks ``b0..b1-1`` of rows ``r0..r0+nrows-1`` into ``buf``'s rows:
    one branch on the type for the four (a branch a row cost 12%)."""
    if qtype == 8:
        for i in range(nrows):
            _dq_q8_0(w[r0 + i], b0, b1, buf[i], lanes)
    elif qtype == 2:
        for i in range(nrows):
            _dq_q4_0(w[r0 + i], b0, b1, buf[i], lanes)
    elif qtype == 3:
        for i in range(nrows):
            _dq_q4_1(w[r0 + i], b0, b1, buf[i], lanes)
    elif qtype == 12:
        for i in range(nrows):
            _dq_q4_k(w[r0 + i], b0, b1, buf[i], lanes)
    elif qtype == 14:
        for i in range(nrows):
            _dq_q6_k(w[r0 + i], b0, b1, buf[i], lanes)
    elif qtype == 6:
        for i in range(nrows):
            _dq_q5_0(w[r0 + i], b0, b1, buf[i], lanes)
    else:
        for i in range(nrows):
            _dequantize_blocks(qtype, w[r0 + i], b0, b1, buf[i], lanes)


# -- batch 1: the GEMV kernels ------------------------------------------------
#
# Each _gemv_* writes y[r] = w[r] . x for rows start..stop-1: a row's blocks
# are dequantized into registers (16 lanes at a time, the dequantizer's
# arithmetic) and multiplied into running sums that stay there until the
# row ends; nothing is stored between the weight bytes and the sum. The
# 32-value types (Q5_0/Q5_1 since issue 34: 2.2-2.6x on SmolLM2's
# matrices, one thread's CPU time) take two rows a pass (the last odd row alone): each ``x``
# vector loaded once for both, and twice the independent sums and weight
# streams in flight, 1.1x on a matrix in L2 and 1.3-2x on SmolLM2's step,
# whose weights come from L3 or memory (a row at a time waited on them).
# They and Q4_K/Q6_K prefetch the bytes _PREFETCH ahead (the next rows',
# contiguous): SmolLM2's 120 Q4_1 layer GEMVs took 9.3 ms of one thread's
# CPU time against 15 without (4 to 16 KB ahead measured alike), where
# numpy streams the same mapped bytes at 14-18 GB/s.


#: how far ahead of the row pair being read the GEMVs prefetch, in bytes
_PREFETCH = 8192


@_jit()
def _gemv_q8_0(
    x: np.ndarray, w: np.ndarray, y: np.ndarray, start: int, stop: int
) -> None:  # pragma: no cover - compiled
    nb = x.shape[0] // 32
    pairs = (stop - start) // 2
    for i in range(pairs):
        r = start + 2 * i
        row, row2 = w[r], w[r + 1]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = a1 = b0 = b1 = _vzero()
        for k in range(nb):
            o = 34 * k
            _prefetch(w, ahead + 2 * o)
            x0, x1 = _vfloats(x, 32 * k), _vfloats(x, 32 * k + 16)
            d = _vsplat(_f16_at(row, o))
            a0 += d * _vfloat(_vint8s(row, o + 2)) * x0
            a1 += d * _vfloat(_vint8s(row, o + 18)) * x1
            d = _vsplat(_f16_at(row2, o))
            b0 += d * _vfloat(_vint8s(row2, o + 2)) * x0
            b1 += d * _vfloat(_vint8s(row2, o + 18)) * x1
        y[r] = _vsum(a0 + a1)
        y[r + 1] = _vsum(b0 + b1)
    for r in range(start + 2 * pairs, stop):
        row = w[r]
        a0 = a1 = _vzero()
        for k in range(nb):
            o = 34 * k
            d = _vsplat(_f16_at(row, o))
            a0 += d * _vfloat(_vint8s(row, o + 2)) * _vfloats(x, 32 * k)
            a1 += d * _vfloat(_vint8s(row, o + 18)) * _vfloats(x, 32 * k + 16)
        y[r] = _vsum(a0 + a1)


@_jit()
def _gemv_q4_0(
    x: np.ndarray, w: np.ndarray, y: np.ndarray, start: int, stop: int
) -> None:  # pragma: no cover - compiled
    nb = x.shape[0] // 32
    low, four, eight = _vsplat(15), _vsplat(4), _vsplat(8)
    pairs = (stop - start) // 2
    for i in range(pairs):
        r = start + 2 * i
        row, row2 = w[r], w[r + 1]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = a1 = b0 = b1 = _vzero()
        for b in range(nb):
            if b % 2 == 0:  # the pair's next 72 bytes
                _prefetch(w, ahead + 36 * b)
                _prefetch(w, ahead + 36 * b + 64)
            x0, x1 = _vfloats(x, 32 * b), _vfloats(x, 32 * b + 16)
            d = _vsplat(_f16_at(row, 18 * b))
            q = _vbytes(row, 18 * b + 2)
            a0 += d * _vfloat((q & low) - eight) * x0
            a1 += d * _vfloat((q >> four) - eight) * x1
            d = _vsplat(_f16_at(row2, 18 * b))
            q = _vbytes(row2, 18 * b + 2)
            b0 += d * _vfloat((q & low) - eight) * x0
            b1 += d * _vfloat((q >> four) - eight) * x1
        y[r] = _vsum(a0 + a1)
        y[r + 1] = _vsum(b0 + b1)
    for r in range(start + 2 * pairs, stop):
        row = w[r]
        a0 = a1 = _vzero()
        for b in range(nb):
            d = _vsplat(_f16_at(row, 18 * b))
            q = _vbytes(row, 18 * b + 2)
            a0 += d * _vfloat((q & low) - eight) * _vfloats(x, 32 * b)
            a1 += d * _vfloat((q >> four) - eight) * _vfloats(x, 32 * b + 16)
        y[r] = _vsum(a0 + a1)


@_jit()
def _gemv_q4_1(
    x: np.ndarray, w: np.ndarray, y: np.ndarray, start: int, stop: int
) -> None:  # pragma: no cover - compiled
    nb = x.shape[0] // 32
    low, four = _vsplat(15), _vsplat(4)
    pairs = (stop - start) // 2
    for i in range(pairs):
        r = start + 2 * i
        row, row2 = w[r], w[r + 1]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = a1 = b0 = b1 = _vzero()
        for b in range(nb):
            if b % 2 == 0:  # the pair's next 80 bytes
                _prefetch(w, ahead + 40 * b)
                _prefetch(w, ahead + 40 * b + 64)
            x0, x1 = _vfloats(x, 32 * b), _vfloats(x, 32 * b + 16)
            d = _vsplat(_f16_at(row, 20 * b))
            m = _vsplat(_f16_at(row, 20 * b + 2))
            q = _vbytes(row, 20 * b + 4)
            a0 += (d * _vfloat(q & low) + m) * x0
            a1 += (d * _vfloat(q >> four) + m) * x1
            d = _vsplat(_f16_at(row2, 20 * b))
            m = _vsplat(_f16_at(row2, 20 * b + 2))
            q = _vbytes(row2, 20 * b + 4)
            b0 += (d * _vfloat(q & low) + m) * x0
            b1 += (d * _vfloat(q >> four) + m) * x1
        y[r] = _vsum(a0 + a1)
        y[r + 1] = _vsum(b0 + b1)
    for r in range(start + 2 * pairs, stop):
        row = w[r]
        a0 = a1 = _vzero()
        for b in range(nb):
            d = _vsplat(_f16_at(row, 20 * b))
            m = _vsplat(_f16_at(row, 20 * b + 2))
            q = _vbytes(row, 20 * b + 4)
            a0 += (d * _vfloat(q & low) + m) * _vfloats(x, 32 * b)
            a1 += (d * _vfloat(q >> four) + m) * _vfloats(x, 32 * b + 16)
        y[r] = _vsum(a0 + a1)


@_jit()
def _q5_values(row: np.ndarray, h: int, q: int, offset: float) -> Any:
    """A Q5_0/Q5_1 block's 32 values plus ``offset`` (0 or -16) as two float
    vectors: the nibbles at byte ``q`` with the fifth bits of the u32 at
    byte ``h`` (bit j: value j's)."""
    nibbles = _vbytes(row, q)
    lo, hi = _vfloat(nibbles & _vsplat(15)), _vfloat(nibbles >> _vsplat(4))
    set_, clear = 16.0 + offset, offset
    return _vaddbits(lo, row, h, set_, clear), _vaddbits(hi, row, h + 2, set_, clear)


@_jit()
def _gemv_q5_0(
    x: np.ndarray, w: np.ndarray, y: np.ndarray, start: int, stop: int
) -> None:  # pragma: no cover - compiled
    """Each row's sum of ``d_b (q - 16) . x_b`` over its blocks as ``d_b (q .
    x_b) - d_b (16 sum x_b)``: the 16 taken off once a block, a scalar
    multiply-add by the block's sum of ``x`` (made once a call), and ``d_b``
    multiplied once a block, not once a half (0.92x one thread's time on
    SmolLM2 Q4_K_M's Q5_0 matrices, docs/benchmarks.md)."""
    nb = x.shape[0] // 32
    sums = np.empty(nb, np.float32)  # 16 times each block's sum of x
    for b in range(nb):
        total = np.float32(0.0)
        for j in range(32 * b, 32 * b + 32):
            total += x[j]
        sums[b] = np.float32(16.0) * total
    pairs = (stop - start) // 2
    for i in range(pairs):
        r = start + 2 * i
        row, row2 = w[r], w[r + 1]
        ahead = r * w.shape[1] + _PREFETCH
        a = c = _vzero()
        off_a = off_c = np.float32(0.0)
        for b in range(nb):
            if b % 2 == 0:  # the pair's next 88 bytes
                _prefetch(w, ahead + 44 * b)
                _prefetch(w, ahead + 44 * b + 64)
            x0, x1 = _vfloats(x, 32 * b), _vfloats(x, 32 * b + 16)
            o = 22 * b
            d = _f16_at(row, o)
            lo, hi = _q5_values(row, o + 2, o + 6, 0.0)
            a += _vsplat(d) * (lo * x0 + hi * x1)
            off_a += d * sums[b]
            d = _f16_at(row2, o)
            lo, hi = _q5_values(row2, o + 2, o + 6, 0.0)
            c += _vsplat(d) * (lo * x0 + hi * x1)
            off_c += d * sums[b]
        y[r] = _vsum(a) - off_a
        y[r + 1] = _vsum(c) - off_c
    for r in range(start + 2 * pairs, stop):
        row = w[r]
        a = _vzero()
        off_a = np.float32(0.0)
        for b in range(nb):
            o = 22 * b
            d = _f16_at(row, o)
            lo, hi = _q5_values(row, o + 2, o + 6, 0.0)
            a += _vsplat(d) * (lo * _vfloats(x, 32 * b) + hi * _vfloats(x, 32 * b + 16))
            off_a += d * sums[b]
        y[r] = _vsum(a) - off_a


@_jit()
def _gemv_q5_1(
    x: np.ndarray, w: np.ndarray, y: np.ndarray, start: int, stop: int
) -> None:  # pragma: no cover - compiled
    nb = x.shape[0] // 32
    pairs = (stop - start) // 2
    for i in range(pairs):
        r = start + 2 * i
        row, row2 = w[r], w[r + 1]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = a1 = b0 = b1 = _vzero()
        for b in range(nb):
            if b % 4 == 0:  # the pair's next 192 bytes
                _prefetch(w, ahead + 48 * b)
                _prefetch(w, ahead + 48 * b + 64)
                _prefetch(w, ahead + 48 * b + 128)
            x0, x1 = _vfloats(x, 32 * b), _vfloats(x, 32 * b + 16)
            o = 24 * b
            d, m = _vsplat(_f16_at(row, o)), _vsplat(_f16_at(row, o + 2))
            lo, hi = _q5_values(row, o + 4, o + 8, 0.0)
            a0 += (d * lo + m) * x0
            a1 += (d * hi + m) * x1
            d, m = _vsplat(_f16_at(row2, o)), _vsplat(_f16_at(row2, o + 2))
            lo, hi = _q5_values(row2, o + 4, o + 8, 0.0)
            b0 += (d * lo + m) * x0
            b1 += (d * hi + m) * x1
        y[r] = _vsum(a0 + a1)
        y[r + 1] = _vsum(b0 + b1)
    for r in range(start + 2 * pairs, stop):
        row = w[r]
        a0 = a1 = _vzero()
        for b in range(nb):
            o = 24 * b
            d, m = _vsplat(_f16_at(row, o)), _vsplat(_f16_at(row, o + 2))
            lo, hi = _q5_values(row, o + 4, o + 8, 0.0)
            a0 += (d * lo + m) * _vfloats(x, 32 * b)
            a1 += (d * hi + m) * _vfloats(x, 32 * b + 16)
        y[r] = _vsum(a0 + a1)


@_jit()
def _gemv_q4_k(
    x: np.ndarray, w: np.ndarray, y: np.ndarray, start: int, stop: int
) -> None:  # pragma: no cover - compiled
    nb = x.shape[0] // 256
    low, four = _vsplat(15), _vsplat(4)
    for r in range(start, stop):
        row = w[r]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = a1 = a2 = a3 = _vzero()
        for b in range(nb):
            o = 144 * b
            d = _f16_at(row, o)
            dmin = _f16_at(row, o + 2)
            scales = row[o + 4 : o + 16]
            for p in range(4):  # 64 values: 32 low nibbles, then 32 high
                if p < 3:  # the block's 144 bytes ahead
                    _prefetch(w, ahead + o + 64 * p)
                qs, e = o + 16 + 32 * p, 256 * b + 64 * p
                sc, m = _scale_min_k4(2 * p, scales)
                d1, m1 = _vsplat(d * np.float32(sc)), _vsplat(dmin * np.float32(m))
                sc, m = _scale_min_k4(2 * p + 1, scales)
                d2, m2 = _vsplat(d * np.float32(sc)), _vsplat(dmin * np.float32(m))
                q0, q1 = _vbytes(row, qs), _vbytes(row, qs + 16)
                a0 += (d1 * _vfloat(q0 & low) - m1) * _vfloats(x, e)
                a1 += (d1 * _vfloat(q1 & low) - m1) * _vfloats(x, e + 16)
                a2 += (d2 * _vfloat(q0 >> four) - m2) * _vfloats(x, e + 32)
                a3 += (d2 * _vfloat(q1 >> four) - m2) * _vfloats(x, e + 48)
        y[r] = _vsum((a0 + a1) + (a2 + a3))


@_jit()
def _gemv_q5_k(
    x: np.ndarray, w: np.ndarray, y: np.ndarray, start: int, stop: int
) -> None:  # pragma: no cover - compiled
    nb = x.shape[0] // 256
    low, one, four = _vsplat(15), _vsplat(1), _vsplat(4)
    for r in range(start, stop):
        row = w[r]
        a0 = a1 = a2 = a3 = _vzero()
        for b in range(nb):
            o = 176 * b
            d = _f16_at(row, o)
            dmin = _f16_at(row, o + 2)
            scales = row[o + 4 : o + 16]
            h0, h1 = _vbytes(row, o + 16), _vbytes(row, o + 32)
            for p in range(4):
                qs, e = o + 48 + 32 * p, 256 * b + 64 * p
                sc, m = _scale_min_k4(2 * p, scales)
                d1, m1 = _vsplat(d * np.float32(sc)), _vsplat(dmin * np.float32(m))
                sc, m = _scale_min_k4(2 * p + 1, scales)
                d2, m2 = _vsplat(d * np.float32(sc)), _vsplat(dmin * np.float32(m))
                s1, s2 = _vsplat(2 * p), _vsplat(2 * p + 1)
                q0, q1 = _vbytes(row, qs), _vbytes(row, qs + 16)
                v0 = (q0 & low) | (((h0 >> s1) & one) << four)
                v1 = (q1 & low) | (((h1 >> s1) & one) << four)
                v2 = (q0 >> four) | (((h0 >> s2) & one) << four)
                v3 = (q1 >> four) | (((h1 >> s2) & one) << four)
                a0 += (d1 * _vfloat(v0) - m1) * _vfloats(x, e)
                a1 += (d1 * _vfloat(v1) - m1) * _vfloats(x, e + 16)
                a2 += (d2 * _vfloat(v2) - m2) * _vfloats(x, e + 32)
                a3 += (d2 * _vfloat(v3) - m2) * _vfloats(x, e + 48)
        y[r] = _vsum((a0 + a1) + (a2 + a3))


@_jit()
def _gemv_q6_k(
    x: np.ndarray, w: np.ndarray, y: np.ndarray, start: int, stop: int
) -> None:  # pragma: no cover - compiled
    nb = x.shape[0] // 256
    low, three, four, offset = _vsplat(15), _vsplat(3), _vsplat(4), _vsplat(32)
    for r in range(start, stop):
        row = w[r]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = a1 = _vzero()
        for b in range(nb):
            o = 210 * b
            d = _f16_at(row, o + 208)
            for h in range(2):  # two halves of 128 values
                qh = o + 128 + 32 * h
                for k in range(4):  # 32 values: ql nibble k // 2, qh bits 2 k
                    if h == 0:  # the block's 210 bytes ahead
                        _prefetch(w, ahead + o + 64 * k)
                    ql = o + 64 * h + 32 * (k % 2)
                    shift, high = _vsplat(4 * (k // 2)), _vsplat(2 * k)
                    e = 128 * h + 32 * k
                    s0 = _vsplat(d * np.float32(np.int8(row[o + 192 + e // 16])))
                    s1 = _vsplat(d * np.float32(np.int8(row[o + 193 + e // 16])))
                    q0 = ((_vbytes(row, ql) >> shift) & low) | (
                        ((_vbytes(row, qh) >> high) & three) << four
                    )
                    q1 = ((_vbytes(row, ql + 16) >> shift) & low) | (
                        ((_vbytes(row, qh + 16) >> high) & three) << four
                    )
                    a0 += s0 * _vfloat(q0 - offset) * _vfloats(x, 256 * b + e)
                    a1 += s1 * _vfloat(q1 - offset) * _vfloats(x, 256 * b + e + 16)
        y[r] = _vsum(a0 + a1)


@_jit()
def _gemv_floats(
    qtype: int, x: np.ndarray, w: np.ndarray, y: np.ndarray, start: int, stop: int
) -> None:  # pragma: no cover - compiled
    """F32, F16 and BF16 rows: 16 values a step, the rest one by one."""
    n = x.shape[0]
    size = 4 if qtype == 0 else 2
    tail = np.empty(1, np.float32)
    for r in range(start, stop):
        row = w[r]
        a0 = a1 = _vzero()
        for p in range(n // 32):
            k = 32 * p
            if qtype == 1:
                a0 += _vhalves(row, 2 * k) * _vfloats(x, k)
                a1 += _vhalves(row, 2 * k + 32) * _vfloats(x, k + 16)
            elif qtype == 30:
                a0 += _vbf16s(row, 2 * k) * _vfloats(x, k)
                a1 += _vbf16s(row, 2 * k + 32) * _vfloats(x, k + 16)
            else:
                a0 += _vfloats(row[: 4 * n].view(np.float32), k) * _vfloats(x, k)
                a1 += _vfloats(row[: 4 * n].view(np.float32), k + 16) * _vfloats(
                    x, k + 16
                )
        s = _vsum(a0 + a1)
        for k in range(n - n % 32, n):
            _dequantize_blocks(qtype, row[size * k : size * k + size], 0, 1, tail, 1)
            s += tail[0] * x[k]
        y[r] = s


@_jit()
def _gemv(
    qtype: int, x: np.ndarray, w: np.ndarray, y: np.ndarray, start: int, stop: int
) -> None:  # pragma: no cover - compiled
    """``y[start:stop] = w[start:stop] @ x`` (``x`` one token's inputs)."""
    if qtype == 8:
        _gemv_q8_0(x, w, y, start, stop)
    elif qtype == 2:
        _gemv_q4_0(x, w, y, start, stop)
    elif qtype == 3:
        _gemv_q4_1(x, w, y, start, stop)
    elif qtype == 12:
        _gemv_q4_k(x, w, y, start, stop)
    elif qtype == 14:
        _gemv_q6_k(x, w, y, start, stop)
    elif qtype == 13:
        _gemv_q5_k(x, w, y, start, stop)
    elif qtype == 6:
        _gemv_q5_0(x, w, y, start, stop)
    elif qtype == 7:
        _gemv_q5_1(x, w, y, start, stop)
    else:
        _gemv_floats(qtype, x, w, y, start, stop)


# -- 2 and 4 tokens: a block dequantized once, multiplied into each token ------
#
# _blk_* dequantize one block (``b``; of a K-quant, the 64 values ``p``) into
# vectors, as the GEMV kernels above do; _gemv2_32/_gemv4_32 multiply each
# dequantized vector into 2 or 4 tokens' running sums, and the buffered
# kernel's _fill32/_fill256 store them into its buffer. Their type is a
# literal (numba compiles a kernel a type, the other types' branches pruned):
# a dispatcher passed as an argument would work too, but numba cannot cache
# a function that passes one.


@_jit()
def _blk_q8_0(row: np.ndarray, b: int) -> Any:  # pragma: no cover - compiled
    o = 34 * b
    d = _vsplat(_f16_at(row, o))
    return d * _vfloat(_vint8s(row, o + 2)), d * _vfloat(_vint8s(row, o + 18))


@_jit()
def _blk_q4_0(row: np.ndarray, b: int) -> Any:  # pragma: no cover - compiled
    d = _vsplat(_f16_at(row, 18 * b))
    q = _vbytes(row, 18 * b + 2)
    eight = _vsplat(8)
    lo = d * _vfloat((q & _vsplat(15)) - eight)
    return lo, d * _vfloat((q >> _vsplat(4)) - eight)


@_jit()
def _blk_q4_1(row: np.ndarray, b: int) -> Any:  # pragma: no cover - compiled
    d = _vsplat(_f16_at(row, 20 * b))
    m = _vsplat(_f16_at(row, 20 * b + 2))
    q = _vbytes(row, 20 * b + 4)
    return d * _vfloat(q & _vsplat(15)) + m, d * _vfloat(q >> _vsplat(4)) + m


@_jit()
def _blk_q5_0(row: np.ndarray, b: int) -> Any:  # pragma: no cover - compiled
    d = _vsplat(_f16_at(row, 22 * b))
    lo, hi = _q5_values(row, 22 * b + 2, 22 * b + 6, -16.0)
    return d * lo, d * hi


@_jit()
def _blk_q5_1(row: np.ndarray, b: int) -> Any:  # pragma: no cover - compiled
    d = _vsplat(_f16_at(row, 24 * b))
    m = _vsplat(_f16_at(row, 24 * b + 2))
    lo, hi = _q5_values(row, 24 * b + 4, 24 * b + 8, 0.0)
    return d * lo + m, d * hi + m


@_jit()
def _blk_q4_k(row: np.ndarray, b: int, p: int) -> Any:  # pragma: no cover
    o = 144 * b
    d, dmin = _f16_at(row, o), _f16_at(row, o + 2)
    scales = row[o + 4 : o + 16]
    low, four = _vsplat(15), _vsplat(4)
    qs = o + 16 + 32 * p
    sc, m = _scale_min_k4(2 * p, scales)
    d1, m1 = _vsplat(d * np.float32(sc)), _vsplat(dmin * np.float32(m))
    sc, m = _scale_min_k4(2 * p + 1, scales)
    d2, m2 = _vsplat(d * np.float32(sc)), _vsplat(dmin * np.float32(m))
    q0, q1 = _vbytes(row, qs), _vbytes(row, qs + 16)
    return (
        d1 * _vfloat(q0 & low) - m1,
        d1 * _vfloat(q1 & low) - m1,
        d2 * _vfloat(q0 >> four) - m2,
        d2 * _vfloat(q1 >> four) - m2,
    )


@_jit()
def _blk_q5_k(row: np.ndarray, b: int, p: int) -> Any:  # pragma: no cover
    o = 176 * b
    d, dmin = _f16_at(row, o), _f16_at(row, o + 2)
    scales = row[o + 4 : o + 16]
    low, one, four = _vsplat(15), _vsplat(1), _vsplat(4)
    h0, h1 = _vbytes(row, o + 16), _vbytes(row, o + 32)
    qs = o + 48 + 32 * p
    sc, m = _scale_min_k4(2 * p, scales)
    d1, m1 = _vsplat(d * np.float32(sc)), _vsplat(dmin * np.float32(m))
    sc, m = _scale_min_k4(2 * p + 1, scales)
    d2, m2 = _vsplat(d * np.float32(sc)), _vsplat(dmin * np.float32(m))
    s1, s2 = _vsplat(2 * p), _vsplat(2 * p + 1)
    q0, q1 = _vbytes(row, qs), _vbytes(row, qs + 16)
    return (
        d1 * _vfloat((q0 & low) | (((h0 >> s1) & one) << four)) - m1,
        d1 * _vfloat((q1 & low) | (((h1 >> s1) & one) << four)) - m1,
        d2 * _vfloat((q0 >> four) | (((h0 >> s2) & one) << four)) - m2,
        d2 * _vfloat((q1 >> four) | (((h1 >> s2) & one) << four)) - m2,
    )


@_jit()
def _blk_q6_k(row: np.ndarray, b: int, p: int) -> Any:  # pragma: no cover
    o = 210 * b
    d = _f16_at(row, o + 208)
    low, three, four, offset = _vsplat(15), _vsplat(3), _vsplat(4), _vsplat(32)
    h = p // 2  # values 128 h + 64 (p % 2) ...: k of 2 (p % 2) and the next
    qh = o + 128 + 32 * h
    out0 = out1 = out2 = out3 = _vzero()
    for i in range(2):
        k = 2 * (p % 2) + i
        ql = o + 64 * h + 32 * (k % 2)
        shift, high = _vsplat(4 * (k // 2)), _vsplat(2 * k)
        e = 128 * h + 32 * k
        s0 = _vsplat(d * np.float32(np.int8(row[o + 192 + e // 16])))
        s1 = _vsplat(d * np.float32(np.int8(row[o + 193 + e // 16])))
        q0 = ((_vbytes(row, ql) >> shift) & low) | (
            ((_vbytes(row, qh) >> high) & three) << four
        )
        q1 = ((_vbytes(row, ql + 16) >> shift) & low) | (
            ((_vbytes(row, qh + 16) >> high) & three) << four
        )
        if i == 0:
            out0, out1 = s0 * _vfloat(q0 - offset), s1 * _vfloat(q1 - offset)
        else:
            out2, out3 = s0 * _vfloat(q0 - offset), s1 * _vfloat(q1 - offset)
    return out0, out1, out2, out3


@_jit()
def _blk32(qtype: int, row: np.ndarray, b: int) -> Any:  # pragma: no cover
    """Block ``b`` of a 32-value type (``qtype`` a constant where called)."""
    if qtype == 3:
        return _blk_q4_1(row, b)
    if qtype == 8:
        return _blk_q8_0(row, b)
    if qtype == 2:
        return _blk_q4_0(row, b)
    if qtype == 6:
        return _blk_q5_0(row, b)
    return _blk_q5_1(row, b)


@_jit()
def _blk256(qtype: int, row: np.ndarray, b: int, p: int) -> Any:  # pragma: no cover
    """Values ``64 p..64 p + 63`` of block ``b`` of a K-quant."""
    if qtype == 12:
        return _blk_q4_k(row, b, p)
    if qtype == 13:
        return _blk_q5_k(row, b, p)
    return _blk_q6_k(row, b, p)


@_jit()
def _gemv2_32(
    qtype: int,
    x: np.ndarray,
    t: int,
    w: np.ndarray,
    y: np.ndarray,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    """Tokens ``t`` and ``t + 1`` of ``x`` against 32-value blocks."""
    numba.literally(qtype)  # a kernel a type: the type's branch folded
    x0, x1 = x[t], x[t + 1]
    y0, y1 = y[t], y[t + 1]
    nb = x.shape[1] // 32
    size = w.shape[1] // nb  # a block's bytes
    for r in range(start, stop):
        row = w[r]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = a1 = c0 = c1 = _vzero()
        for b in range(nb):
            _prefetch(w, ahead + size * b)
            v0, v1 = _blk32(qtype, row, b)
            a0 += v0 * _vfloats(x0, 32 * b)
            a1 += v1 * _vfloats(x0, 32 * b + 16)
            c0 += v0 * _vfloats(x1, 32 * b)
            c1 += v1 * _vfloats(x1, 32 * b + 16)
        y0[r] = _vsum(a0 + a1)
        y1[r] = _vsum(c0 + c1)


@_jit()
def _gemv4_32(
    qtype: int,
    x: np.ndarray,
    t: int,
    w: np.ndarray,
    y: np.ndarray,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    """Tokens ``t..t + 3`` of ``x`` against 32-value blocks."""
    numba.literally(qtype)  # a kernel a type: the type's branch folded
    x0, x1, x2, x3 = x[t], x[t + 1], x[t + 2], x[t + 3]
    y0, y1, y2, y3 = y[t], y[t + 1], y[t + 2], y[t + 3]
    nb = x.shape[1] // 32
    size = w.shape[1] // nb  # a block's bytes
    for r in range(start, stop):
        row = w[r]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = a1 = b0 = b1 = c0 = c1 = e0 = e1 = _vzero()
        for b in range(nb):
            _prefetch(w, ahead + size * b)
            v0, v1 = _blk32(qtype, row, b)
            k = 32 * b
            a0 += v0 * _vfloats(x0, k)
            a1 += v1 * _vfloats(x0, k + 16)
            b0 += v0 * _vfloats(x1, k)
            b1 += v1 * _vfloats(x1, k + 16)
            c0 += v0 * _vfloats(x2, k)
            c1 += v1 * _vfloats(x2, k + 16)
            e0 += v0 * _vfloats(x3, k)
            e1 += v1 * _vfloats(x3, k + 16)
        y0[r] = _vsum(a0 + a1)
        y1[r] = _vsum(b0 + b1)
        y2[r] = _vsum(c0 + c1)
        y3[r] = _vsum(e0 + e1)


@_jit()
def _gemv_tokens(
    qtype: int,
    x: np.ndarray,
    t: int,
    n: int,
    w: np.ndarray,
    y: np.ndarray,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    """Tokens ``t..t + n - 1`` (``n`` 2 or 4) of a 32-value type's GEMV."""
    if qtype == 3:
        if n == 4:
            _gemv4_32(3, x, t, w, y, start, stop)
        else:
            _gemv2_32(3, x, t, w, y, start, stop)
    elif qtype == 8:
        if n == 4:
            _gemv4_32(8, x, t, w, y, start, stop)
        else:
            _gemv2_32(8, x, t, w, y, start, stop)
    elif qtype == 2:
        if n == 4:
            _gemv4_32(2, x, t, w, y, start, stop)
        else:
            _gemv2_32(2, x, t, w, y, start, stop)
    elif qtype == 6:
        if n == 4:
            _gemv4_32(6, x, t, w, y, start, stop)
        else:
            _gemv2_32(6, x, t, w, y, start, stop)
    elif n == 4:
        _gemv4_32(7, x, t, w, y, start, stop)
    else:
        _gemv2_32(7, x, t, w, y, start, stop)


# -- q8 activations -----------------------------------------------------------
#
# ``x`` quantized once a call as llama.cpp's quantize_row_q8_0/q8_1 do on
# x86 (their AVX code, not the C reference: a block of 32: d = max |x| /
# 127, q = x * (127 / max |x|) rounded half to even, d kept as an f16, s =
# f16(d * sum q)), into arrays the kernels read 16 lanes at a time: ``xq``
# the int8 values, ``dx`` each block's d eight times over (a pair of blocks
# is one 16-lane vector), ``sx`` s / 8 likewise (eight lanes sum to s) and
# ``xs4`` the sums of four consecutive q times the weight type's offset (its
# correction: sum((q_w - 8) q) = dot(q_w, q) - 8 sum(q); the multiply made
# once a call, not a shift a row and token: 0-5% of a Q4_0/Q5_0 GEMV).
# Blocks come in pairs; an odd last block pairs with zeros.

#: 32-value weight types the Q8_0/Q8_1 kernels take (:data:`Q8K_TYPES` take
#: Q8_K blocks, the rest multiply float activations)
Q8_TYPES = frozenset(
    {GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1}
)


@_jit(fastmath=_EXACT)
def _quantize_q8(
    x: np.ndarray,  # (T, n) float32, n a multiple of 32
    xq: np.ndarray,  # (T, 64 pairs) int8
    dx: np.ndarray,  # (T, 16 pairs) float32
    sx: np.ndarray,  # (T, 16 pairs) float32
    xs4: np.ndarray,  # (T, 16 pairs) int32
    gd: np.ndarray,  # (T, blocks or 0) float32: d, once a block (panels)
    gi: np.ndarray,  # (T, blocks or 0) int32: the panels' offset times sum(q)
    gm: np.ndarray,  # (T, blocks or 0) float32: s
    qtype: int,  # the weight's
    t0: int,
    t1: int,  # tokens t0..t1-1
) -> None:  # pragma: no cover - compiled
    nb = x.shape[1] // 32
    # the weight type's offset: 8 (Q4_0), 16 (Q5_0), else 0; the byte
    # panels hold Q8_0's values plus 128
    offset = 8 if qtype == 2 else 16 if qtype == 6 else 0
    panel_offset = 128 if qtype == 8 else offset
    panels = gd.shape[1] > 0
    for t in range(t0, t1):
        xt, qt, dt, st, ft = x[t], xq[t], dx[t], sx[t], xs4[t]
        for b in range(nb):
            v0, v1 = _vfloats(xt, 32 * b), _vfloats(xt, 32 * b + 16)
            amax = _vabsmax2(v0, v1)
            d = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            q0, q1 = _vround(v0, inv), _vround(v1, inv)  # half to even
            _vstore8(qt, 32 * b, q0)
            _vstore8(qt, 32 * b + 16, q1)
            total = _visum(q0 + q1)
            dh = _f16_round(d)
            sh = _f16_round(np.float32(total) * d)
            for j in range(8):
                dt[8 * b + j] = dh
                st[8 * b + j] = sh * np.float32(0.125)
            if panels:
                gd[t, b], gi[t, b], gm[t, b] = dh, -panel_offset * total, sh
            for j in range(8 if offset else 0):
                ft[8 * b + j] = np.int32(offset) * (
                    np.int32(qt[32 * b + 4 * j])
                    + np.int32(qt[32 * b + 4 * j + 1])
                    + np.int32(qt[32 * b + 4 * j + 2])
                    + np.int32(qt[32 * b + 4 * j + 3])
                )


# Each _gemv8_* writes y[r] = w[r] . x for rows start..stop-1 from one
# token's q8 arrays, a pair of blocks a step: the weight's 64 values as
# bytes, their integer dot with the activations' into 16 int32 lanes (8 a
# block), one float multiply-add by d_w d_x. ``ob`` is the second block's
# offset, the first's again past an odd row's end (against zeros in x).
# Q8_0, Q5_0 and Q5_1 take _gemv8r2 (two rows a pass, below) instead
# (Q8_0's 1.05-1.17x its own GEMV's once its scales were off a chain).


@_jit()
def _gemv8_q4_0(
    xq: np.ndarray,
    dx: np.ndarray,
    sx: np.ndarray,
    xs4: np.ndarray,
    nb: int,
    w: np.ndarray,
    y: np.ndarray,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    for r in range(start, stop):
        row = w[r]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = _vzero()
        for p in range((nb + 1) // 2):
            oa = 36 * p
            _prefetch(w, ahead + oa)
            ob = oa + 18 if 2 * p + 1 < nb else oa
            d = _vsplat2(_f16_at(row, oa), _f16_at(row, ob)) * _vfloats(dx, 16 * p)
            dot = _vdot(_bnib2(row, oa + 2, ob + 2), _bint8s(xq, 64 * p))
            a0 += d * _vfloat(dot - _vints(xs4, 16 * p))
        y[r] = _vsum(a0)


@_jit()
def _gemv8_q4_1(
    xq: np.ndarray,
    dx: np.ndarray,
    sx: np.ndarray,
    xs4: np.ndarray,
    nb: int,
    w: np.ndarray,
    y: np.ndarray,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    for r in range(start, stop):
        row = w[r]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = a1 = _vzero()
        for p in range((nb + 1) // 2):
            oa = 40 * p
            _prefetch(w, ahead + oa)
            ob = oa + 20 if 2 * p + 1 < nb else oa
            d = _vsplat2(_f16_at(row, oa), _f16_at(row, ob)) * _vfloats(dx, 16 * p)
            m = _vsplat2(_f16_at(row, oa + 2), _f16_at(row, ob + 2))
            dot = _vdot(_bnib2(row, oa + 4, ob + 4), _bint8s(xq, 64 * p))
            a0 += d * _vfloat(dot)
            a1 += m * _vfloats(sx, 16 * p)
        y[r] = _vsum(a0 + a1)


# Several tokens: a pair of blocks unpacked to bytes once (_w8), its integer
# dot with each token's activations (_acc8); the type a literal, as above.


@_jit()
def _w8(qtype: int, row: np.ndarray, p: int, nb: int) -> Any:  # pragma: no cover
    """Blocks ``2 p`` and ``2 p + 1`` of a row: (64 values as bytes, d_w
    and m_w as :func:`_vsplat2` pairs; m zero for types without one)."""
    if qtype == 3:
        oa = 40 * p
        ob = oa + 20 if 2 * p + 1 < nb else oa
        m = _vsplat2(_f16_at(row, oa + 2), _f16_at(row, ob + 2))
        d = _vsplat2(_f16_at(row, oa), _f16_at(row, ob))
        return _bnib2(row, oa + 4, ob + 4), d, m
    if qtype == 8:
        oa = 68 * p
        ob = oa + 34 if 2 * p + 1 < nb else oa
        d = _vsplat2(_f16_at(row, oa), _f16_at(row, ob))
        return _bq8x2(row, oa + 2, ob + 2), d, _vzero()
    if qtype == 2:
        oa = 36 * p
        ob = oa + 18 if 2 * p + 1 < nb else oa
        d = _vsplat2(_f16_at(row, oa), _f16_at(row, ob))
        return _bnib2(row, oa + 2, ob + 2), d, _vzero()
    if qtype == 6:
        oa = 44 * p
        ob = oa + 22 if 2 * p + 1 < nb else oa
        d = _vsplat2(_f16_at(row, oa), _f16_at(row, ob))
        q = _bnib2(row, oa + 6, ob + 6) | _bhigh2(row, oa + 2, ob + 2)
        return q, d, _vzero()
    oa = 48 * p  # Q5_1
    ob = oa + 24 if 2 * p + 1 < nb else oa
    m = _vsplat2(_f16_at(row, oa + 2), _f16_at(row, ob + 2))
    d = _vsplat2(_f16_at(row, oa), _f16_at(row, ob))
    return _bnib2(row, oa + 8, ob + 8) | _bhigh2(row, oa + 4, ob + 4), d, m


@_jit()
def _acc8(
    qtype: int,
    q: Any,
    dw: Any,
    m: Any,
    xq: np.ndarray,
    dx: np.ndarray,
    sx: np.ndarray,
    xs4: np.ndarray,
    p: int,
    a: Any,
    c: Any,
) -> Any:  # pragma: no cover - compiled
    """One token's sums ``a`` (the dot) and ``c`` (the mins) after the
    pair of blocks ``p`` (``q``, ``dw``, ``m`` from :func:`_w8`)."""
    d = dw * _vfloats(dx, 16 * p)
    x = _bint8s(xq, 64 * p)
    if qtype == 8:
        return a + d * _vfloat(_vdots(q, x)), c
    if qtype == 2:
        return a + d * _vfloat(_vdot(q, x) - _vints(xs4, 16 * p)), c
    if qtype == 6:
        return a + d * _vfloat(_vdot(q, x) - _vints(xs4, 16 * p)), c
    return a + d * _vfloat(_vdot(q, x)), c + m * _vfloats(sx, 16 * p)


@_jit()
def _gemv8x2(
    qtype: int,
    xq: np.ndarray,
    dx: np.ndarray,
    sx: np.ndarray,
    xs4: np.ndarray,
    nb: int,
    w: np.ndarray,
    out: np.ndarray,
    t: int,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    """Tokens ``t`` and ``t + 1`` of the q8 arrays."""
    numba.literally(qtype)
    q0, d0, s0, f0 = xq[t], dx[t], sx[t], xs4[t]
    q1, d1, s1, f1 = xq[t + 1], dx[t + 1], sx[t + 1], xs4[t + 1]
    y0, y1 = out[t], out[t + 1]
    pair = 2 * (w.shape[1] // nb)  # two blocks' bytes
    for r in range(start, stop):
        row = w[r]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = c0 = a1 = c1 = _vzero()
        for p in range((nb + 1) // 2):
            _prefetch(w, ahead + pair * p)
            q, dw, m = _w8(qtype, row, p, nb)
            a0, c0 = _acc8(qtype, q, dw, m, q0, d0, s0, f0, p, a0, c0)
            a1, c1 = _acc8(qtype, q, dw, m, q1, d1, s1, f1, p, a1, c1)
        y0[r] = _vsum(a0 + c0)
        y1[r] = _vsum(a1 + c1)


@_jit()
def _gemv8x4(
    qtype: int,
    xq: np.ndarray,
    dx: np.ndarray,
    sx: np.ndarray,
    xs4: np.ndarray,
    nb: int,
    w: np.ndarray,
    out: np.ndarray,
    t: int,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    """Tokens ``t..t + 3`` of the q8 arrays."""
    numba.literally(qtype)
    q0, d0, s0, f0 = xq[t], dx[t], sx[t], xs4[t]
    q1, d1, s1, f1 = xq[t + 1], dx[t + 1], sx[t + 1], xs4[t + 1]
    q2, d2, s2, f2 = xq[t + 2], dx[t + 2], sx[t + 2], xs4[t + 2]
    q3, d3, s3, f3 = xq[t + 3], dx[t + 3], sx[t + 3], xs4[t + 3]
    y0, y1, y2, y3 = out[t], out[t + 1], out[t + 2], out[t + 3]
    pair = 2 * (w.shape[1] // nb)  # two blocks' bytes
    lines = (2 * pair + 63) // 64  # two rows' worth
    pairs = (stop - start) // 2
    for i in range(pairs):  # two rows: each token's activations loaded once
        r = start + 2 * i
        row, row2 = w[r], w[r + 1]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = c0 = a1 = c1 = a2 = c2 = a3 = c3 = _vzero()
        b0 = e0 = b1 = e1 = b2 = e2 = b3 = e3 = _vzero()
        for p in range((nb + 1) // 2):
            for j in range(lines):
                _prefetch(w, ahead + 2 * pair * p + 64 * j)
            q, dw, m = _w8(qtype, row, p, nb)
            v, dv, n = _w8(qtype, row2, p, nb)
            a0, c0 = _acc8(qtype, q, dw, m, q0, d0, s0, f0, p, a0, c0)
            b0, e0 = _acc8(qtype, v, dv, n, q0, d0, s0, f0, p, b0, e0)
            a1, c1 = _acc8(qtype, q, dw, m, q1, d1, s1, f1, p, a1, c1)
            b1, e1 = _acc8(qtype, v, dv, n, q1, d1, s1, f1, p, b1, e1)
            a2, c2 = _acc8(qtype, q, dw, m, q2, d2, s2, f2, p, a2, c2)
            b2, e2 = _acc8(qtype, v, dv, n, q2, d2, s2, f2, p, b2, e2)
            a3, c3 = _acc8(qtype, q, dw, m, q3, d3, s3, f3, p, a3, c3)
            b3, e3 = _acc8(qtype, v, dv, n, q3, d3, s3, f3, p, b3, e3)
        y0[r], y0[r + 1] = _vsum(a0 + c0), _vsum(b0 + e0)
        y1[r], y1[r + 1] = _vsum(a1 + c1), _vsum(b1 + e1)
        y2[r], y2[r + 1] = _vsum(a2 + c2), _vsum(b2 + e2)
        y3[r], y3[r + 1] = _vsum(a3 + c3), _vsum(b3 + e3)
    for r in range(start + 2 * pairs, stop):
        row = w[r]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = c0 = a1 = c1 = a2 = c2 = a3 = c3 = _vzero()
        for p in range((nb + 1) // 2):
            _prefetch(w, ahead + pair * p)
            q, dw, m = _w8(qtype, row, p, nb)
            a0, c0 = _acc8(qtype, q, dw, m, q0, d0, s0, f0, p, a0, c0)
            a1, c1 = _acc8(qtype, q, dw, m, q1, d1, s1, f1, p, a1, c1)
            a2, c2 = _acc8(qtype, q, dw, m, q2, d2, s2, f2, p, a2, c2)
            a3, c3 = _acc8(qtype, q, dw, m, q3, d3, s3, f3, p, a3, c3)
        y0[r] = _vsum(a0 + c0)
        y1[r] = _vsum(a1 + c1)
        y2[r] = _vsum(a2 + c2)
        y3[r] = _vsum(a3 + c3)


@_jit()
def _gemv8r2(
    qtype: int,
    xq: np.ndarray,
    dx: np.ndarray,
    sx: np.ndarray,
    xs4: np.ndarray,
    nb: int,
    w: np.ndarray,
    y: np.ndarray,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    """One token's q8 arrays against rows ``start..stop-1``, two rows a
    pass (the last odd one alone) with their bytes prefetched, as the
    float GEMVs; each row's sums as :func:`_gemv8x2`'s."""
    numba.literally(qtype)
    pair = 2 * (w.shape[1] // nb)  # two blocks' bytes
    lines = (2 * pair + 63) // 64  # two rows' worth
    pairs = (stop - start) // 2
    for i in range(pairs):
        r = start + 2 * i
        row, row2 = w[r], w[r + 1]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = c0 = a1 = c1 = _vzero()
        for p in range((nb + 1) // 2):
            for j in range(lines):
                _prefetch(w, ahead + 2 * pair * p + 64 * j)
            q, dw, m = _w8(qtype, row, p, nb)
            a0, c0 = _acc8(qtype, q, dw, m, xq, dx, sx, xs4, p, a0, c0)
            q, dw, m = _w8(qtype, row2, p, nb)
            a1, c1 = _acc8(qtype, q, dw, m, xq, dx, sx, xs4, p, a1, c1)
        y[r] = _vsum(a0 + c0)
        y[r + 1] = _vsum(a1 + c1)
    for r in range(start + 2 * pairs, stop):
        row = w[r]
        a0 = c0 = _vzero()
        for p in range((nb + 1) // 2):
            q, dw, m = _w8(qtype, row, p, nb)
            a0, c0 = _acc8(qtype, q, dw, m, xq, dx, sx, xs4, p, a0, c0)
        y[r] = _vsum(a0 + c0)


@_jit()
def _gemv8_tokens(
    qtype: int,
    n: int,
    xq: np.ndarray,
    dx: np.ndarray,
    sx: np.ndarray,
    xs4: np.ndarray,
    nb: int,
    w: np.ndarray,
    out: np.ndarray,
    t: int,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    """Tokens ``t..t + n - 1`` (``n`` 2 or 4) of the q8 arrays."""
    if qtype == 3:
        if n == 4:
            _gemv8x4(3, xq, dx, sx, xs4, nb, w, out, t, start, stop)
        else:
            _gemv8x2(3, xq, dx, sx, xs4, nb, w, out, t, start, stop)
    elif qtype == 8:
        if n == 4:
            _gemv8x4(8, xq, dx, sx, xs4, nb, w, out, t, start, stop)
        else:
            _gemv8x2(8, xq, dx, sx, xs4, nb, w, out, t, start, stop)
    elif qtype == 2:
        if n == 4:
            _gemv8x4(2, xq, dx, sx, xs4, nb, w, out, t, start, stop)
        else:
            _gemv8x2(2, xq, dx, sx, xs4, nb, w, out, t, start, stop)
    elif qtype == 6:
        if n == 4:
            _gemv8x4(6, xq, dx, sx, xs4, nb, w, out, t, start, stop)
        else:
            _gemv8x2(6, xq, dx, sx, xs4, nb, w, out, t, start, stop)
    elif n == 4:
        _gemv8x4(7, xq, dx, sx, xs4, nb, w, out, t, start, stop)
    else:
        _gemv8x2(7, xq, dx, sx, xs4, nb, w, out, t, start, stop)


@_jit()
def _matmul8_rows(
    xq: np.ndarray,
    dx: np.ndarray,
    sx: np.ndarray,
    xs4: np.ndarray,
    nb: int,
    w: np.ndarray,
    qtype: int,
    out: np.ndarray,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    t_len, t = xq.shape[0], 0
    while t + 4 <= t_len:
        _gemv8_tokens(qtype, 4, xq, dx, sx, xs4, nb, w, out, t, start, stop)
        t += 4
    while t + 2 <= t_len:
        _gemv8_tokens(qtype, 2, xq, dx, sx, xs4, nb, w, out, t, start, stop)
        t += 2
    if t < t_len:
        q, d, s, f, y = xq[t], dx[t], sx[t], xs4[t], out[t]
        if qtype == 3:
            _gemv8_q4_1(q, d, s, f, nb, w, y, start, stop)
        elif qtype == 8:
            _gemv8r2(8, q, d, s, f, nb, w, y, start, stop)
        elif qtype == 2:
            _gemv8_q4_0(q, d, s, f, nb, w, y, start, stop)
        elif qtype == 6:
            _gemv8r2(6, q, d, s, f, nb, w, y, start, stop)
        else:
            _gemv8r2(7, q, d, s, f, nb, w, y, start, stop)


@_jit()
def _q8_acts(x: np.ndarray, qtype: int, panels: bool) -> Any:  # pragma: no cover
    """The q8 arrays of a call on ``x`` against a ``qtype`` weight, not yet
    quantized: ``(xq, d, s, a, b, gd, gi, gm)``, one shape for both routes.

    Q8_0/Q8_1 blocks (:data:`Q8_TYPES`, :func:`_quantize_q8`): ``xq`` the
    bytes a pair of blocks at a time, ``d``/``s`` the scales and sums
    (``dx``, ``sx``), ``a`` the offset terms (``xs4``), ``b`` empty. Q8_K
    (:data:`Q8K_TYPES`, :func:`_quantize_q8k`): ``xq`` the bytes, ``d`` a
    block's scale (``dk``), ``s`` empty, ``a``/``b`` the sums of 16 and 32
    values (``bs16``, ``bs32``). The byte panels' group terms ``gd`` (``d_x``),
    ``gi`` (the integer sums' start) and ``gm`` (the mins' factor) have a
    column a weight group when ``panels``, none otherwise.
    """
    t_len, n = x.shape
    if qtype == 12 or qtype == 14:
        nb = n // 256
        groups = (16 if qtype == 14 else 8) * nb if panels else 0
        return (
            np.empty((t_len, n), np.int8),
            np.empty((t_len, nb), np.float32),
            np.empty((t_len, 0), np.float32),
            np.empty((t_len, 16 * nb), np.int32),
            np.zeros((t_len, 16 * nb), np.int32),
            np.empty((t_len, groups), np.float32),
            np.empty((t_len, groups), np.int32),
            np.empty((t_len, groups), np.float32),
        )
    nb = n // 32
    pairs = (nb + 1) // 2
    groups = nb if panels else 0
    return (
        np.zeros((t_len, 64 * pairs), np.int8),
        np.zeros((t_len, 16 * pairs), np.float32),
        np.zeros((t_len, 16 * pairs), np.float32),
        np.zeros((t_len, 16 * pairs), np.int32),
        np.empty((t_len, 0), np.int32),
        np.empty((t_len, groups), np.float32),
        np.empty((t_len, groups), np.int32),
        np.empty((t_len, groups), np.float32),
    )


@_jit()
def _q8_quantize(
    x: np.ndarray,
    xq: np.ndarray,
    d: np.ndarray,
    s: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    gd: np.ndarray,
    gi: np.ndarray,
    gm: np.ndarray,
    qtype: int,
    t0: int,
    t1: int,
) -> None:  # pragma: no cover - compiled
    """Tokens ``t0..t1-1`` of ``x`` into the arrays of :func:`_q8_acts`."""
    if qtype == 12 or qtype == 14:
        _quantize_q8k(x, xq, d, a, b, gd, gi, gm, qtype, t0, t1)
    else:
        _quantize_q8(x, xq, d, s, a, gd, gi, gm, qtype, t0, t1)


@_jit()
def _q8_arrays(x: np.ndarray, qtype: int) -> Any:  # pragma: no cover - compiled
    """The arrays of :func:`_q8_acts` for ``x``, quantized (no panels)."""
    acts = _q8_acts(x, qtype, False)
    xq, d, s, a, b, gd, gi, gm = acts
    _q8_quantize(x, xq, d, s, a, b, gd, gi, gm, qtype, 0, x.shape[0])
    return acts


@_jit()
def _q8_rows(
    xq: np.ndarray,
    d: np.ndarray,
    s: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    w: np.ndarray,
    qtype: int,
    n: int,  # in_features
    out: np.ndarray,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    """Rows ``start..stop-1`` for every token by the route's GEMVs."""
    if qtype == 12 or qtype == 14:
        _matmul8k_rows(xq, d, a, b, w, qtype, out, start, stop)
    else:
        _matmul8_rows(xq, d, s, a, n // 32, w, qtype, out, start, stop)


@_jit()
def _q8_panels(
    qtype: int,
    xq: np.ndarray,
    gd: np.ndarray,
    gi: np.ndarray,
    gm: np.ndarray,
    w: np.ndarray,
    n: int,
    out: np.ndarray,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    """:func:`_q8_panel_rows`, each type its own kernel."""
    if qtype == 8:
        _q8_panel_rows(8, xq, gd, gi, gm, w, 32, n, out, start, stop)
    elif qtype == 2:
        _q8_panel_rows(2, xq, gd, gi, gm, w, 32, n, out, start, stop)
    elif qtype == 3:
        _q8_panel_rows(3, xq, gd, gi, gm, w, 32, n, out, start, stop)
    elif qtype == 6:
        _q8_panel_rows(6, xq, gd, gi, gm, w, 32, n, out, start, stop)
    elif qtype == 7:
        _q8_panel_rows(7, xq, gd, gi, gm, w, 32, n, out, start, stop)
    elif qtype == 12:
        _q8_panel_rows(12, xq, gd, gi, gm, w, 256, n, out, start, stop)
    else:
        _q8_panel_rows(14, xq, gd, gi, gm, w, 256, n, out, start, stop)


@_jit()
def _matmul8(
    x: np.ndarray, w: np.ndarray, qtype: int, out: np.ndarray, start: int
) -> None:  # pragma: no cover - compiled
    """``out = x @ W.T`` with q8 activations, on the calling thread, rows
    ``start..`` (0, given at run time: a literal 0 would compile the panel
    kernels under it again, specialised for it): whole 32-row panels in
    bytes from ``_Q8_PANEL_TOKENS`` tokens, the other rows (all of them
    below) by the GEMVs."""
    t_len, rows = x.shape[0], w.shape[0]
    panels = _q8_panel_route(qtype, t_len, rows - start)
    xq, d, s, a, b, gd, gi, gm = _q8_acts(x, qtype, panels)
    _q8_quantize(x, xq, d, s, a, b, gd, gi, gm, qtype, 0, t_len)
    if panels:
        whole = start + _OUTER_ROWS * ((rows - start) // _OUTER_ROWS)
        _q8_panels(qtype, xq, gd, gi, gm, w, x.shape[1], out, start, whole)
        start = whole
    _q8_rows(xq, d, s, a, b, w, qtype, x.shape[1], out, start, rows)


@_jit(parallel=True)
def _matmul8_parallel(
    x: np.ndarray, w: np.ndarray, qtype: int, out: np.ndarray, parts: int
) -> None:  # pragma: no cover - compiled
    """:func:`_matmul8` over ``parts`` threads: the tokens quantized in
    parts from twice the panel threshold, then the rows in parts."""
    t_len, rows = x.shape[0], w.shape[0]
    panels = _q8_panel_route(qtype, t_len, rows)
    xq, d, s, a, b, gd, gi, gm = _q8_acts(x, qtype, panels)
    if t_len >= 2 * _Q8_PANEL_TOKENS:
        for p in _prange(parts):
            t0, t1 = p * t_len // parts, (p + 1) * t_len // parts
            _q8_quantize(x, xq, d, s, a, b, gd, gi, gm, qtype, t0, t1)
    else:
        _q8_quantize(x, xq, d, s, a, b, gd, gi, gm, qtype, 0, t_len)
    if panels:
        whole = rows // _OUTER_ROWS  # panels; the last rows by the GEMVs
        for p in _prange(parts):
            start = _OUTER_ROWS * (p * whole // parts)
            stop = _OUTER_ROWS * ((p + 1) * whole // parts)
            _q8_panels(qtype, xq, gd, gi, gm, w, x.shape[1], out, start, stop)
        _q8_rows(xq, d, s, a, b, w, qtype, x.shape[1], out, _OUTER_ROWS * whole, rows)
        return
    quads = (rows + _ROWS - 1) // _ROWS
    for p in _prange(parts):
        start = _ROWS * (p * quads // parts)
        stop = min(rows, _ROWS * ((p + 1) * quads // parts))
        _q8_rows(xq, d, s, a, b, w, qtype, x.shape[1], out, start, stop)


# -- q8 activations for the K-quants: Q8_K ---------------------------------------
#
# As llama.cpp's ggml_vec_dot_q4_K_q8_K/q6_K_q8_K: ``x`` quantized to blocks
# of 256 as its quantize_row_q8_K_ref (which x86 runs; its repacked Q4_K
# path's AVX quantizer agrees but where +max and -max both occur): m the
# first value of the largest magnitude, q = x * (-127 / m) rounded half to
# even (so q has the opposite sign of x where m > 0), at most 127, and the
# float32 d = 1 / (-127 / m), one scale a super-block: ``xq`` int8 and ``dk`` float32 (T, blocks)) and
# the sums of each 16 q (``bs16``, int32 16 a block) and each 32 (``bs32``,
# 8 a block, then 8 zeros). A weight block's products are integers: each
# 64-value chunk's bytes against x's by :func:`_vdotsc`, its 6-bit (Q4_K) or
# int8 (Q6_K) sub-block scales multiplied in by the same instructions, the
# chunks summed in int32; Q4_K's mins and Q6_K's offset of 32 are one
# vector product with the bsums (sum(m_j q_w) over a sub-block is m_j
# bsum_j). Then one float multiply-add by d_w d_x (and dmin_w d_x) a block.

#: K-quants the q8 kernels take (their activations as Q8_K blocks)
Q8K_TYPES = frozenset({GGMLType.Q4_K, GGMLType.Q6_K})


@_jit(fastmath=_EXACT)
def _quantize_q8k(
    x: np.ndarray,  # (T, n) float32, n a multiple of 256
    xq: np.ndarray,  # (T, n) int8
    dk: np.ndarray,  # (T, blocks) float32
    bs16: np.ndarray,  # (T, 16 blocks) int32
    bs32: np.ndarray,  # (T, 16 blocks) int32, zeros
    gd: np.ndarray,  # (T, groups or 0) float32: d, a weight group (panels)
    gi: np.ndarray,  # (T, groups or 0) int32: Q6_K's offset of 32 x bs16
    gm: np.ndarray,  # (T, groups or 0) float32: Q4_K's d x bs32
    qtype: int,  # the weight's: 12 (Q4_K, groups of 32) or 14 (Q6_K, of 16)
    t0: int,
    t1: int,  # tokens t0..t1-1
) -> None:  # pragma: no cover - compiled
    nb = x.shape[1] // 256
    per = 16 if qtype == 14 else 8  # a block's weight groups
    panels = gd.shape[1] > 0
    for t in range(t0, t1):
        xt, qt, dt, s16, s32 = x[t], xq[t], dk[t], bs16[t], bs32[t]
        for b in range(nb):
            o = 256 * b
            amax = top = np.float32(0.0)
            for g in range(8):
                v0, v1 = _vfloats(xt, o + 32 * g), _vfloats(xt, o + 32 * g + 16)
                amax = max(amax, _vabsmax2(v0, v1))
            if amax != 0:  # the first value of the largest magnitude
                j = 0
                while abs(xt[o + j]) != amax:
                    j += 1
                top = xt[o + j]
            inv = np.float32(-127.0) / top if amax != 0 else np.float32(0.0)
            d = np.float32(1.0) / inv if amax != 0 else np.float32(0.0)
            for g in range(16):
                # half to even; llama.cpp's min(127, q) is never reached:
                # |x inv| <= 127 (1 + 2^-24)^2 < 127.5
                q = _vround(_vfloats(xt, o + 16 * g), inv)
                _vstore8(qt, o + 16 * g, q)
                s16[16 * b + g] = _visum(q)
            for g in range(8):
                s32[16 * b + g] = s16[16 * b + 2 * g] + s16[16 * b + 2 * g + 1]
            dt[b] = d
            for g in range(per if panels else 0):
                gd[t, per * b + g] = d
                if qtype == 14:
                    gi[t, per * b + g], gm[t, per * b + g] = -32 * s16[16 * b + g], 0
                else:
                    gi[t, per * b + g] = 0
                    gm[t, per * b + g] = d * np.float32(s32[16 * b + g])


@_jit()
def _kw(qtype: int, row: np.ndarray, b: int) -> Any:  # pragma: no cover
    """Block ``b`` of a Q4_K or Q6_K row (``qtype`` a literal) as the q8
    kernels read it: its four 64-value chunks as bytes (values 0..15 or
    0..63), each chunk's scales spread over its dot's lanes, the mins
    (Q4_K) or scales (Q6_K) that meet the bsums, d and dmin (Q6_K: 0)."""
    if qtype == 12:
        o = 144 * b
        s0, s1, s2 = _u32_at(row, o + 4), _u32_at(row, o + 8), _u32_at(row, o + 12)
        six, four, two = (
            np.uint32(0x3F3F3F3F),
            np.uint32(0x0F0F0F0F),
            np.uint32(0x03030303),
        )
        # llama.cpp's unpacking of the 12 bytes: 8 scales, then 8 mins
        scales = _vbytes8(s0 & six, (s2 & four) | (((s0 >> 6) & two) << 4))
        mins = _vbytes8(s1 & six, ((s2 >> 4) & four) | (((s1 >> 6) & two) << 4))
        return (
            _bnib32(row, o + 16),
            _bnib32(row, o + 48),
            _bnib32(row, o + 80),
            _bnib32(row, o + 112),
            _vspread(scales, 8, 0),
            _vspread(scales, 8, 1),
            _vspread(scales, 8, 2),
            _vspread(scales, 8, 3),
            mins,
            _f16_at(row, o),
            _f16_at(row, o + 2),
        )
    o = 210 * b
    scales = _vint8s(row, o + 192)
    return (
        _bq6(row, o, o + 128, 0),
        _bq6(row, o, o + 128, 1),
        _bq6(row, o + 64, o + 160, 0),
        _bq6(row, o + 64, o + 160, 1),
        _vspread(scales, 4, 0),
        _vspread(scales, 4, 1),
        _vspread(scales, 4, 2),
        _vspread(scales, 4, 3),
        scales,
        _f16_at(row, o + 208),
        np.float32(0.0),
    )


@_jit()
def _kacc(
    qtype: int,
    k: Any,
    xq: np.ndarray,
    dk: np.ndarray,
    bs16: np.ndarray,
    bs32: np.ndarray,
    b: int,
    a: Any,
    c: Any,
) -> Any:  # pragma: no cover - compiled
    """One token's sums ``a`` (the scaled dots) and ``c`` (the mins, taken
    off at the end) after block ``b`` (``k`` from :func:`_kw`)."""
    q0, q1, q2, q3, s0, s1, s2, s3, m, dw, dmin = k
    o = 256 * b
    isum = (_vdotsc(q0, _bint8s(xq, o), s0) + _vdotsc(q1, _bint8s(xq, o + 64), s1)) + (
        _vdotsc(q2, _bint8s(xq, o + 128), s2) + _vdotsc(q3, _bint8s(xq, o + 192), s3)
    )
    dx = dk[b]
    if qtype == 12:
        mins = m * _vints(bs32, 16 * b)
        return a + _vsplat(dw * dx) * _vfloat(isum), c + _vsplat(dmin * dx) * _vfloat(
            mins
        )
    offset = (m * _vints(bs16, 16 * b)) << _vsplat(5)  # 32 sum(sc_j bsum_j)
    return a + _vsplat(dw * dx) * _vfloat(isum - offset), c


@_jit()
def _gemvk(
    qtype: int,
    xq: np.ndarray,
    dk: np.ndarray,
    bs16: np.ndarray,
    bs32: np.ndarray,
    w: np.ndarray,
    y: np.ndarray,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    """One token's Q8_K arrays against rows ``start..stop-1``, two a pass
    (the last odd one alone), prefetching as the float GEMVs do."""
    numba.literally(qtype)
    nb = dk.shape[0]
    size = w.shape[1] // nb
    lines = (2 * size + 63) // 64
    pairs = (stop - start) // 2
    for i in range(pairs):
        r = start + 2 * i
        row, row2 = w[r], w[r + 1]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = c0 = a1 = c1 = _vzero()
        for b in range(nb):
            for j in range(lines):
                _prefetch(w, ahead + 2 * size * b + 64 * j)
            a0, c0 = _kacc(qtype, _kw(qtype, row, b), xq, dk, bs16, bs32, b, a0, c0)
            a1, c1 = _kacc(qtype, _kw(qtype, row2, b), xq, dk, bs16, bs32, b, a1, c1)
        y[r] = _vsum(a0 - c0)
        y[r + 1] = _vsum(a1 - c1)
    for r in range(start + 2 * pairs, stop):
        row = w[r]
        a0 = c0 = _vzero()
        for b in range(nb):
            a0, c0 = _kacc(qtype, _kw(qtype, row, b), xq, dk, bs16, bs32, b, a0, c0)
        y[r] = _vsum(a0 - c0)


@_jit()
def _gemvk_x2(
    qtype: int,
    xq: np.ndarray,
    dk: np.ndarray,
    bs16: np.ndarray,
    bs32: np.ndarray,
    w: np.ndarray,
    out: np.ndarray,
    t: int,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    """Tokens ``t`` and ``t + 1``: a block unpacked once for both."""
    numba.literally(qtype)
    q0, d0, e0, f0 = xq[t], dk[t], bs16[t], bs32[t]
    q1, d1, e1, f1 = xq[t + 1], dk[t + 1], bs16[t + 1], bs32[t + 1]
    y0, y1 = out[t], out[t + 1]
    nb = dk.shape[1]
    size = w.shape[1] // nb
    lines = (size + 63) // 64
    for r in range(start, stop):
        row = w[r]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = c0 = a1 = c1 = _vzero()
        for b in range(nb):
            for j in range(lines):
                _prefetch(w, ahead + size * b + 64 * j)
            k = _kw(qtype, row, b)
            a0, c0 = _kacc(qtype, k, q0, d0, e0, f0, b, a0, c0)
            a1, c1 = _kacc(qtype, k, q1, d1, e1, f1, b, a1, c1)
        y0[r] = _vsum(a0 - c0)
        y1[r] = _vsum(a1 - c1)


@_jit()
def _gemvk_x4(
    qtype: int,
    xq: np.ndarray,
    dk: np.ndarray,
    bs16: np.ndarray,
    bs32: np.ndarray,
    w: np.ndarray,
    out: np.ndarray,
    t: int,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    """Tokens ``t..t + 3``: a block unpacked once for the four."""
    numba.literally(qtype)
    q0, d0, e0, f0 = xq[t], dk[t], bs16[t], bs32[t]
    q1, d1, e1, f1 = xq[t + 1], dk[t + 1], bs16[t + 1], bs32[t + 1]
    q2, d2, e2, f2 = xq[t + 2], dk[t + 2], bs16[t + 2], bs32[t + 2]
    q3, d3, e3, f3 = xq[t + 3], dk[t + 3], bs16[t + 3], bs32[t + 3]
    y0, y1, y2, y3 = out[t], out[t + 1], out[t + 2], out[t + 3]
    nb = dk.shape[1]
    size = w.shape[1] // nb
    lines = (size + 63) // 64
    for r in range(start, stop):
        row = w[r]
        ahead = r * w.shape[1] + _PREFETCH
        a0 = c0 = a1 = c1 = a2 = c2 = a3 = c3 = _vzero()
        for b in range(nb):
            for j in range(lines):
                _prefetch(w, ahead + size * b + 64 * j)
            k = _kw(qtype, row, b)
            a0, c0 = _kacc(qtype, k, q0, d0, e0, f0, b, a0, c0)
            a1, c1 = _kacc(qtype, k, q1, d1, e1, f1, b, a1, c1)
            a2, c2 = _kacc(qtype, k, q2, d2, e2, f2, b, a2, c2)
            a3, c3 = _kacc(qtype, k, q3, d3, e3, f3, b, a3, c3)
        y0[r] = _vsum(a0 - c0)
        y1[r] = _vsum(a1 - c1)
        y2[r] = _vsum(a2 - c2)
        y3[r] = _vsum(a3 - c3)


@_jit()
def _matmul8k_rows(
    xq: np.ndarray,
    dk: np.ndarray,
    bs16: np.ndarray,
    bs32: np.ndarray,
    w: np.ndarray,
    qtype: int,
    out: np.ndarray,
    start: int,
    stop: int,
) -> None:  # pragma: no cover - compiled
    """Rows ``start..stop-1`` for every token, 4, 2 and 1 at a time (a
    token's sums the same in each: its result whatever ``T`` is)."""
    t_len, t = xq.shape[0], 0
    while t + 4 <= t_len:
        if qtype == 12:
            _gemvk_x4(12, xq, dk, bs16, bs32, w, out, t, start, stop)
        else:
            _gemvk_x4(14, xq, dk, bs16, bs32, w, out, t, start, stop)
        t += 4
    while t + 2 <= t_len:
        if qtype == 12:
            _gemvk_x2(12, xq, dk, bs16, bs32, w, out, t, start, stop)
        else:
            _gemvk_x2(14, xq, dk, bs16, bs32, w, out, t, start, stop)
        t += 2
    if t < t_len:
        if qtype == 12:
            _gemvk(12, xq[t], dk[t], bs16[t], bs32[t], w, out[t], start, stop)
        else:
            _gemvk(14, xq[t], dk[t], bs16[t], bs32[t], w, out[t], start, stop)


#: inputs dequantized at a time: 4 rows of it are a thread's 16 KB buffer
_CHUNK = 1024
#: weight rows the micro-kernel reads at once
_ROWS = 4
#: past ``_TILE_FLOATS`` floats of ``x`` a chunk (256 KB), the buffered
#: kernel dequantizes ``_PANEL`` rows at a time and multiplies them
#: ``_TILE`` tokens at a time, each quad of the panel sweeping the same tile
#: of ``x`` while it is in L2; below it, a quad at a time sweeps all of
#: ``x``. Both sum every output in the same order (the same bits). 2
#: threads, 3072 x 576 and 576 x 1536, Q8_0 and Q4_1: at 1024 tokens 47-68
#: G multiply-adds a second became 78-103 (the sweep re-read ``x`` from L3
#: for every quad); at 16-136 tokens the quad at a time was 1.0-1.15x the
#: panel's.
_TILE_FLOATS = 1 << 16
_PANEL = 128
_TILE = 64
#: up to this many tokens a call of a 32-value type takes the GEMV kernels
#: (4, 2 and 1 tokens at a time); more take the buffered kernel. Since its
#: buffer is filled by vector dequantizers, one thread's CPU time on 3072 x
#: 576 (Q4_1, Q8_0, Q5_0), GEMVs / buffered: T of 2 0.58-0.66x, 3 0.8-1.1x,
#: 4 0.70-0.84x, 5 1.0-1.2x, 6 1.0-1.1x, 8 1.1-1.25x. K-quants take the
#: GEMV at one token only: at 2 tokens their GEMVs measured 0.99x (Q4_K)
#: and 1.2x (Q6_K) the buffered kernel's time, at 4 0.89x and 1.19x.
_GEMV_TOKENS = 4
#: the most tokens a GEMV kernel takes at once (4 or 2)
_GEMV_GROUP = 4
#: the 32-value types (GGML numbers): the GEMVs of several tokens take these
_BLOCK_TYPES = (2, 3, 6, 7, 8)


@_jit()
def _micro(
    x: np.ndarray,  # (T, in)
    t0: int,  # the tokens: t0..t1-1
    t1: int,
    k0: int,  # the chunk: inputs k0..k0+kn-1
    kn: int,
    buf: np.ndarray,  # (4, >= kn): 4 dequantized weight rows
    out: np.ndarray,  # (T, out_features)
    r0: int,  # the first row's output column
    nrows: int,  # how many of the 4 are real rows
    accumulate: bool,  # add to out (a later chunk) or write it (the first)
    sums: np.ndarray,  # (4, 4) float32 scratch
) -> None:  # pragma: no cover - compiled
    """``out[t0:t1, r0:r0 + nrows] (+)= x[t0:t1, k0:k0 + kn] @ buf[:nrows,
    :kn].T``: 4 rows x 4 tokens a pass, 16 sums vectorised along the inputs
    (each row of ``x`` is sliced on its own: a 2-D column slice would not be
    contiguous, and numba reads it element by element)."""
    t_len = t1 - t0
    w0, w1, w2, w3 = buf[0, :kn], buf[1, :kn], buf[2, :kn], buf[3, :kn]
    for tq in range(t_len // 4):
        t = t0 + 4 * tq
        x0, x1 = x[t, k0 : k0 + kn], x[t + 1, k0 : k0 + kn]
        x2, x3 = x[t + 2, k0 : k0 + kn], x[t + 3, k0 : k0 + kn]
        s00 = s01 = s02 = s03 = np.float32(0.0)
        s10 = s11 = s12 = s13 = np.float32(0.0)
        s20 = s21 = s22 = s23 = np.float32(0.0)
        s30 = s31 = s32 = s33 = np.float32(0.0)
        for k in range(kn):
            a0, a1, a2, a3 = x0[k], x1[k], x2[k], x3[k]
            v0, v1, v2, v3 = w0[k], w1[k], w2[k], w3[k]
            s00 += a0 * v0
            s01 += a0 * v1
            s02 += a0 * v2
            s03 += a0 * v3
            s10 += a1 * v0
            s11 += a1 * v1
            s12 += a1 * v2
            s13 += a1 * v3
            s20 += a2 * v0
            s21 += a2 * v1
            s22 += a2 * v2
            s23 += a2 * v3
            s30 += a3 * v0
            s31 += a3 * v1
            s32 += a3 * v2
            s33 += a3 * v3
        sums[0, 0], sums[0, 1], sums[0, 2], sums[0, 3] = s00, s01, s02, s03
        sums[1, 0], sums[1, 1], sums[1, 2], sums[1, 3] = s10, s11, s12, s13
        sums[2, 0], sums[2, 1], sums[2, 2], sums[2, 3] = s20, s21, s22, s23
        sums[3, 0], sums[3, 1], sums[3, 2], sums[3, 3] = s30, s31, s32, s33
        for i in range(4):
            dst = out[t + i, r0 : r0 + nrows]
            for r in range(nrows):
                dst[r] = dst[r] + sums[i, r] if accumulate else sums[i, r]
    for t in range(t1 - t_len % 4, t1):
        xt = x[t, k0 : k0 + kn]
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for k in range(kn):
            a = xt[k]
            s0 += a * w0[k]
            s1 += a * w1[k]
            s2 += a * w2[k]
            s3 += a * w3[k]
        sums[0, 0], sums[0, 1], sums[0, 2], sums[0, 3] = s0, s1, s2, s3
        dst = out[t, r0 : r0 + nrows]
        for r in range(nrows):
            dst[r] = dst[r] + sums[0, r] if accumulate else sums[0, r]


@_jit()
def _micro16(
    x: np.ndarray,  # (T, in)
    t0: int,  # the tokens: t0..t1-1
    t1: int,
    k0: int,  # the chunk: inputs k0..k0+kn-1, kn a multiple of 16
    kn: int,
    buf: np.ndarray,  # (4, >= kn): 4 dequantized weight rows
    out: np.ndarray,  # (T, out_features)
    r0: int,  # the first row's output column
    nrows: int,  # how many of the 4 are real rows
    accumulate: bool,  # add to out (a later chunk) or write it (the first)
    sums: np.ndarray,  # (4, 4) float32 scratch
) -> None:  # pragma: no cover - compiled
    """:func:`_micro` with its 16 sums spelled out as vectors (16 lanes of
    inputs each, reduced once a chunk): 1.1-1.2x its time at ``T`` of 16,
    where LLVM's own vectorisation of the scalar sums left it short."""
    t_len = t1 - t0
    w0, w1, w2, w3 = buf[0], buf[1], buf[2], buf[3]
    for tq in range(t_len // 4):
        t = t0 + 4 * tq
        x0, x1 = x[t, k0 : k0 + kn], x[t + 1, k0 : k0 + kn]
        x2, x3 = x[t + 2, k0 : k0 + kn], x[t + 3, k0 : k0 + kn]
        s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = _vzero()
        s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = _vzero()
        for j in range(kn // 16):
            k = 16 * j
            v0, v1 = _vfloats(w0, k), _vfloats(w1, k)
            v2, v3 = _vfloats(w2, k), _vfloats(w3, k)
            a = _vfloats(x0, k)
            s00 += a * v0
            s01 += a * v1
            s02 += a * v2
            s03 += a * v3
            a = _vfloats(x1, k)
            s10 += a * v0
            s11 += a * v1
            s12 += a * v2
            s13 += a * v3
            a = _vfloats(x2, k)
            s20 += a * v0
            s21 += a * v1
            s22 += a * v2
            s23 += a * v3
            a = _vfloats(x3, k)
            s30 += a * v0
            s31 += a * v1
            s32 += a * v2
            s33 += a * v3
        sums[0, 0], sums[0, 1] = _vsum(s00), _vsum(s01)
        sums[0, 2], sums[0, 3] = _vsum(s02), _vsum(s03)
        sums[1, 0], sums[1, 1] = _vsum(s10), _vsum(s11)
        sums[1, 2], sums[1, 3] = _vsum(s12), _vsum(s13)
        sums[2, 0], sums[2, 1] = _vsum(s20), _vsum(s21)
        sums[2, 2], sums[2, 3] = _vsum(s22), _vsum(s23)
        sums[3, 0], sums[3, 1] = _vsum(s30), _vsum(s31)
        sums[3, 2], sums[3, 3] = _vsum(s32), _vsum(s33)
        for i in range(4):
            dst = out[t + i, r0 : r0 + nrows]
            for r in range(nrows):
                dst[r] = dst[r] + sums[i, r] if accumulate else sums[i, r]
    for t in range(t1 - t_len % 4, t1):
        xt = x[t, k0 : k0 + kn]
        s0 = s1 = s2 = s3 = _vzero()
        for j in range(kn // 16):
            k = 16 * j
            a = _vfloats(xt, k)
            s0 += a * _vfloats(w0, k)
            s1 += a * _vfloats(w1, k)
            s2 += a * _vfloats(w2, k)
            s3 += a * _vfloats(w3, k)
        sums[0, 0], sums[0, 1] = _vsum(s0), _vsum(s1)
        sums[0, 2], sums[0, 3] = _vsum(s2), _vsum(s3)
        dst = out[t, r0 : r0 + nrows]
        for r in range(nrows):
            dst[r] = dst[r] + sums[0, r] if accumulate else sums[0, r]


# The buffered kernel's block types fill its buffer from the GEMVs'
# dequantizers (_blk32/_blk256: vectors, fastmath, stored 16 lanes at a
# time) rather than the exact scalar _dq_* ones, which were most of a
# T-of-16 call's time: 1.2-1.5x at 16 tokens (Q4_1, Q5_0, Q6_K), 1.0-1.2x
# for Q8_0, 0.99x for Q4_K (whose exact fill measured 0.83x beside the
# vector micro-kernel). The type is a literal, as in the GEMVs of several
# tokens.


@_jit()
def _fill32(
    qtype: int, w: np.ndarray, r0: int, nrows: int, b0: int, b1: int, buf: np.ndarray
) -> None:  # pragma: no cover - compiled
    """Blocks ``b0..b1-1`` of rows ``r0..r0+nrows-1`` (32-value blocks)."""
    numba.literally(qtype)  # a kernel a type: the type's branch folded
    for i in range(nrows):
        row, dst = w[r0 + i], buf[i]
        for b in range(b0, b1):
            v0, v1 = _blk32(qtype, row, b)
            _vstore(dst, 32 * (b - b0), v0)
            _vstore(dst, 32 * (b - b0) + 16, v1)


@_jit()
def _fill256(
    qtype: int, w: np.ndarray, r0: int, nrows: int, b0: int, b1: int, buf: np.ndarray
) -> None:  # pragma: no cover - compiled
    """Blocks ``b0..b1-1`` of rows ``r0..r0+nrows-1`` (K-quant blocks)."""
    numba.literally(qtype)  # a kernel a type: the type's branch folded
    for i in range(nrows):
        row, dst = w[r0 + i], buf[i]
        for b in range(b0, b1):
            for p in range(4):
                v0, v1, v2, v3 = _blk256(qtype, row, b, p)
                k = 256 * (b - b0) + 64 * p
                _vstore(dst, k, v0)
                _vstore(dst, k + 16, v1)
                _vstore(dst, k + 32, v2)
                _vstore(dst, k + 48, v3)


@_jit()
def _fill_quad(
    qtype: int,
    w: np.ndarray,
    r0: int,
    nrows: int,
    b0: int,
    b1: int,
    buf: np.ndarray,
    lanes: int,
) -> None:  # pragma: no cover - compiled
    """:func:`_dequantize_quad`'s job, vectorised for the block types."""
    if qtype == 3:
        _fill32(3, w, r0, nrows, b0, b1, buf)
    elif qtype == 8:
        _fill32(8, w, r0, nrows, b0, b1, buf)
    elif qtype == 2:
        _fill32(2, w, r0, nrows, b0, b1, buf)
    elif qtype == 6:
        _fill32(6, w, r0, nrows, b0, b1, buf)
    elif qtype == 7:
        _fill32(7, w, r0, nrows, b0, b1, buf)
    elif qtype == 12:
        _fill256(12, w, r0, nrows, b0, b1, buf)
    elif qtype == 13:
        _fill256(13, w, r0, nrows, b0, b1, buf)
    elif qtype == 14:
        _fill256(14, w, r0, nrows, b0, b1, buf)
    else:
        _dequantize_quad(qtype, w, r0, nrows, b0, b1, buf, lanes)


# -- many tokens: 32 rows as the lanes of two vectors --------------------------
#
# From ``_OUTER_TOKENS`` tokens a call, rows of 32 are dequantized into the
# buffer as above and transposed (16 x 16 blocks in registers) into a
# panel whose input ``k`` is the 32 rows' weights side by side; a token's
# input ``x[t, k]`` is broadcast and multiplied into both vectors of
# running sums. Each output is one lane's sum over the inputs in order: no
# horizontal sum a row, where the 4x4 micro-kernel folds 16 vector sums
# at the end of each chunk (a third of its time at 576 inputs). 2 threads,
# SmolLM2's four projections, Q8_0: 136 tokens 75 -> 118 G multiply-adds a
# second, 512 tokens 75 -> 134; at 16 tokens the transposes cost more than
# they save (38 against 66).

#: from this many tokens a call multiplies transposed 32-row panels
_OUTER_TOKENS = 32
#: rows of a transposed panel: two vectors
_OUTER_ROWS = 32
#: inputs of a panel multiplied at a time: 32 KB of it, which stays in L1
#: while 8 tokens' sums sweep it (72 -> 88 G multiply-adds a second a
#: thread against 576 inputs from L2)
_OUTER_K = 256


@_jit(inline=True)
def _outer8(
    x: np.ndarray,  # (T, in)
    t: int,  # tokens t..t+7
    k0: int,
    kn: int,
    panel: np.ndarray,  # (>= kn * 32,) the rows' weights, input-major
    out: np.ndarray,  # (T, out_features)
    r0: int,
    accumulate: bool,
) -> None:  # pragma: no cover - compiled
    """``out[t:t + 8, r0:r0 + 32] (+)= x[t:t + 8, k0:k0 + kn] @ rows.T``."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _vzero()
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = _vzero()
    x0, x1 = x[t, k0 : k0 + kn], x[t + 1, k0 : k0 + kn]
    x2, x3 = x[t + 2, k0 : k0 + kn], x[t + 3, k0 : k0 + kn]
    x4, x5 = x[t + 4, k0 : k0 + kn], x[t + 5, k0 : k0 + kn]
    x6, x7 = x[t + 6, k0 : k0 + kn], x[t + 7, k0 : k0 + kn]
    for k in range(kn):
        u = _vfloats(panel, _OUTER_ROWS * k)
        v = _vfloats(panel, _OUTER_ROWS * k + 16)
        s = _vsplat(x0[k])
        a0 += s * u
        b0 += s * v
        s = _vsplat(x1[k])
        a1 += s * u
        b1 += s * v
        s = _vsplat(x2[k])
        a2 += s * u
        b2 += s * v
        s = _vsplat(x3[k])
        a3 += s * u
        b3 += s * v
        s = _vsplat(x4[k])
        a4 += s * u
        b4 += s * v
        s = _vsplat(x5[k])
        a5 += s * u
        b5 += s * v
        s = _vsplat(x6[k])
        a6 += s * u
        b6 += s * v
        s = _vsplat(x7[k])
        a7 += s * u
        b7 += s * v
    _outer_store(out, t, r0, a0, b0, accumulate)
    _outer_store(out, t + 1, r0, a1, b1, accumulate)
    _outer_store(out, t + 2, r0, a2, b2, accumulate)
    _outer_store(out, t + 3, r0, a3, b3, accumulate)
    _outer_store(out, t + 4, r0, a4, b4, accumulate)
    _outer_store(out, t + 5, r0, a5, b5, accumulate)
    _outer_store(out, t + 6, r0, a6, b6, accumulate)
    _outer_store(out, t + 7, r0, a7, b7, accumulate)


@_jit(inline=True)
def _outer1(
    x: np.ndarray,
    t: int,  # one token
    k0: int,
    kn: int,
    panel: np.ndarray,
    out: np.ndarray,
    r0: int,
    accumulate: bool,
) -> None:  # pragma: no cover - compiled
    """:func:`_outer8` for one token: each lane's sum in the same order."""
    a = b = _vzero()
    xt = x[t, k0 : k0 + kn]
    for k in range(kn):
        s = _vsplat(xt[k])
        a += s * _vfloats(panel, _OUTER_ROWS * k)
        b += s * _vfloats(panel, _OUTER_ROWS * k + 16)
    _outer_store(out, t, r0, a, b, accumulate)


@_jit(inline=True)
def _outer_store(
    out: np.ndarray, t: int, r0: int, a: Any, b: Any, accumulate: bool
) -> None:  # pragma: no cover - compiled
    at = t * out.shape[1] + r0
    if accumulate:  # a later chunk: the sums so far, then this chunk's
        a = _vfloats(out, at) + a
        b = _vfloats(out, at + 16) + b
    _vstore(out, at, a)
    _vstore(out, at + 16, b)


@_jit(inline=True)
def _outer_rows(
    x: np.ndarray,  # (T, in) float32, in a multiple of 16
    w: np.ndarray,  # (out_features, row_bytes) uint8
    qtype: int,
    values: int,
    out: np.ndarray,  # (T, out_features)
    start: int,
    stop: int,  # start + a multiple of 32
    lanes: int,
) -> None:  # pragma: no cover - compiled
    """Rows ``start..stop-1`` for every token, 32 rows a panel: up to
    ``_PANEL`` rows' panels made at a time, then each ``_TILE`` tokens'
    rows of ``x`` multiplied into all of them while they are in L2."""
    t_len, n = x.shape
    chunk = min(n, _CHUNK)
    buf = np.zeros((_OUTER_ROWS, chunk + 16), np.float32)
    flat = buf.reshape(-1)
    width = buf.shape[1]
    panels = np.empty(_PANEL * chunk, np.float32)
    size = _OUTER_ROWS * chunk  # a panel's floats
    for p0 in range(start, stop, _PANEL):
        count = min(_PANEL, stop - p0) // _OUTER_ROWS
        for c in range((n + chunk - 1) // chunk):
            k0 = c * chunk
            kn = min(chunk, n - k0)
            b0, b1 = k0 // values, (k0 + kn) // values
            for j in range(count):
                r0 = p0 + _OUTER_ROWS * j
                _fill_quad(qtype, w, r0, _OUTER_ROWS, b0, b1, buf, lanes)
                for half in range(2):
                    for kb in range(kn // 16):
                        _vtranspose16(
                            flat, 16 * (half * width + kb), width,
                            panels, j * size + 16 * (kb * _OUTER_ROWS + half),
                            _OUTER_ROWS,
                        )  # fmt: skip
            # the chunk in equal parts of at most _OUTER_K, a multiple of 16
            parts = (kn + _OUTER_K - 1) // _OUTER_K
            step = 16 * ((kn // 16 + parts - 1) // parts)
            for t0 in range(0, t_len, _TILE):
                t1 = min(t_len, t0 + _TILE)
                for j in range(count):
                    r0 = p0 + _OUTER_ROWS * j
                    for ks in range(0, kn, step):  # <= 32 KB of the panel
                        kl = min(step, kn - ks)
                        at = j * size + _OUTER_ROWS * ks
                        panel = panels[at : at + _OUTER_ROWS * kl]
                        more = c > 0 or ks > 0
                        t = t0
                        while t + 8 <= t1:
                            _outer8(x, t, k0 + ks, kl, panel, out, r0, more)
                            t += 8
                        while t < t1:
                            _outer1(x, t, k0 + ks, kl, panel, out, r0, more)
                            t += 1


# -- q8 activations at many tokens: 32 rows' bytes as the lanes -----------------
#
# From ``_Q8_PANEL_TOKENS`` tokens a q8 call, whole 32-row panels go the
# float outer product's way in integers: a panel's values unpacked to one
# byte each (the GEMVs' unpackers; Q8_0's signed bytes plus 128) and
# transposed as 32-bit words, so four inputs of 32 rows are two 64-byte
# vectors; each token's four activation bytes are broadcast and one
# ``vpdpbusd`` a vector adds their products into 16 rows' int32 sums. A
# group of inputs that shares a weight scale (32 values, Q6_K's 16) ends in
# one conversion and one float multiply-add a vector by ``d_w d_x`` (and
# one by the mins: Q4_1, Q5_1, Q4_K), and the next group's integer sums
# start from the type's offset times the group's activation sum (Q4_0's 8,
# Q5_0's 16, Q8_0's 128, Q6_K's 32). 4 tokens x 32 rows: 8 int32 and 8
# float sums in registers; the panel 512 inputs at a time (16 KB, in L1).
# The integer products are exact: a token's result is llama.cpp's to
# float32 summation order, and the same bits in any call of at least
# ``_Q8_PANEL_TOKENS`` tokens (not the GEMVs' bits: their lanes sum in
# another order). Q8_0's unsigned bytes reach 255, where ``vpmaddubsw``'s
# int16 pairs saturate: without VNNI it keeps its GEMVs.

#: from this many tokens a q8 call multiplies 32-row byte panels: SmolLM2's
#: projections at 5, 6 and 7 tokens 1.05-1.5x the GEMVs of 4, 2 and 1, at 4
#: 0.8-1.0x (2 threads, Q8_0, Q4_1, Q5_0)
_Q8_PANEL_TOKENS = 5
#: inputs of a byte panel unpacked at a time (the rest of a row: another)
_Q8_PANEL_CHUNK = 2048
#: inputs of a byte panel multiplied at a time: 16 KB, which stays in L1
_Q8_PANEL_K = 512
#: whether the host's dot products are exact on Q8_0's bytes (0..255)
_Q8_PANEL_Q8_0 = numba is not None and _dot_isa() in ("vnni", "generic")


@_jit()
def _q8_unpack(
    qtype: int,
    w: np.ndarray,  # (out_features, row_bytes) uint8
    r0: int,  # rows r0..r0+31
    b0: int,
    b1: int,  # the weight's blocks b0..b1-1
    rows: np.ndarray,  # (32, >= the values rounded up to 64) uint8
    sc: np.ndarray,  # (groups x 32,) float32: d_w a group, 32 rows side by side
    mn: np.ndarray,  # (groups x 32,) float32: the mins' factor, where any
) -> None:  # pragma: no cover - compiled
    """A panel's values as unsigned bytes and its groups' scales."""
    numba.literally(qtype)
    for i in range(_OUTER_ROWS):
        row, dst = w[r0 + i], rows[i]
        if qtype == 12 or qtype == 14:  # K-quants: 256 values a block
            for b in range(b0, b1):
                k = 256 * (b - b0)
                if qtype == 12:
                    o = 144 * b
                    d, dmin = _f16_at(row, o), _f16_at(row, o + 2)
                    for p in range(4):
                        _bstore(dst, k + 64 * p, _bnib32(row, o + 16 + 32 * p))
                    scales = row[o + 4 : o + 16]
                    for j in range(8):
                        s, m = _scale_min_k4(j, scales)
                        g = 8 * (b - b0) + j
                        sc[32 * g + i] = d * np.float32(s)
                        mn[32 * g + i] = -(dmin * np.float32(m))
                else:
                    o = 210 * b
                    d = _f16_at(row, o + 208)
                    _bstore(dst, k, _bq6(row, o, o + 128, 0))
                    _bstore(dst, k + 64, _bq6(row, o, o + 128, 1))
                    _bstore(dst, k + 128, _bq6(row, o + 64, o + 160, 0))
                    _bstore(dst, k + 192, _bq6(row, o + 64, o + 160, 1))
                    for j in range(16):
                        g = 16 * (b - b0) + j
                        sc[32 * g + i] = d * np.float32(np.int8(row[o + 192 + j]))
            continue
        for b in range(b0, b1, 2):  # two blocks a store (an odd last: twice)
            g, h = b - b0, b + 1 if b + 1 < b1 else b
            k = 32 * g
            if qtype == 8:
                oa, ob = 34 * b, 34 * h
                _bstore(dst, k, _bflip(_bq8x2(row, oa + 2, ob + 2)))
            elif qtype == 2:
                oa, ob = 18 * b, 18 * h
                _bstore(dst, k, _bnib2(row, oa + 2, ob + 2))
            elif qtype == 3:
                oa, ob = 20 * b, 20 * h
                _bstore(dst, k, _bnib2(row, oa + 4, ob + 4))
                mn[32 * g + i] = _f16_at(row, oa + 2)
                mn[32 * g + 32 + i] = _f16_at(row, ob + 2)
            elif qtype == 6:
                oa, ob = 22 * b, 22 * h
                q = _bnib2(row, oa + 6, ob + 6) | _bhigh2(row, oa + 2, ob + 2)
                _bstore(dst, k, q)
            else:  # Q5_1
                oa, ob = 24 * b, 24 * h
                q = _bnib2(row, oa + 8, ob + 8) | _bhigh2(row, oa + 4, ob + 4)
                _bstore(dst, k, q)
                mn[32 * g + i] = _f16_at(row, oa + 2)
                mn[32 * g + 32 + i] = _f16_at(row, ob + 2)
            sc[32 * g + i] = _f16_at(row, oa)
            sc[32 * g + 32 + i] = _f16_at(row, ob)


@_jit(inline=True)
def _q8_panel4(
    qtype: int,
    xq: np.ndarray,  # (T, >= in) int8
    gd: np.ndarray,  # (T, groups) float32: d_x a group
    gi: np.ndarray,  # (T, groups) int32: the integer sums' start
    gm: np.ndarray,  # (T, groups) float32: what the mins multiply
    t: int,  # tokens t..t+3
    v0: int,  # the panel's first input
    g0: int,
    g1: int,  # its groups g0..g1-1
    panel: np.ndarray,  # bytes: input k's 4-byte word of row r at 128 (k // 4) + 4 r
    sc: np.ndarray,
    mn: np.ndarray,
    out: np.ndarray,
    r0: int,
    more: bool,
) -> None:  # pragma: no cover - compiled
    """``out[t:t + 4, r0:r0 + 32] (+)=`` the groups' products."""
    kg = 4 if qtype == 14 else 8  # 4-byte words a group
    base = v0 // (4 * kg)
    x0, x1, x2, x3 = xq[t, v0:], xq[t + 1, v0:], xq[t + 2, v0:], xq[t + 3, v0:]
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = _vzero()
    for g in range(g0, g1):
        i0 = j0 = _vsplat(gi[t, base + g])
        i1 = j1 = _vsplat(gi[t + 1, base + g])
        i2 = j2 = _vsplat(gi[t + 2, base + g])
        i3 = j3 = _vsplat(gi[t + 3, base + g])
        for k in range(kg * g, kg * g + kg):
            u = _bint8s(panel, 128 * k)
            v = _bint8s(panel, 128 * k + 64)
            s = _bsplat4(x0, 4 * k)
            i0 = _vdotacc(i0, u, s)
            j0 = _vdotacc(j0, v, s)
            s = _bsplat4(x1, 4 * k)
            i1 = _vdotacc(i1, u, s)
            j1 = _vdotacc(j1, v, s)
            s = _bsplat4(x2, 4 * k)
            i2 = _vdotacc(i2, u, s)
            j2 = _vdotacc(j2, v, s)
            s = _bsplat4(x3, 4 * k)
            i3 = _vdotacc(i3, u, s)
            j3 = _vdotacc(j3, v, s)
        d, e = _vfloats(sc, 32 * g), _vfloats(sc, 32 * g + 16)
        s0, s1 = _vsplat(gd[t, base + g]), _vsplat(gd[t + 1, base + g])
        s2, s3 = _vsplat(gd[t + 2, base + g]), _vsplat(gd[t + 3, base + g])
        a0 = _vfma(d * s0, _vfloat(i0), a0)
        b0 = _vfma(e * s0, _vfloat(j0), b0)
        a1 = _vfma(d * s1, _vfloat(i1), a1)
        b1 = _vfma(e * s1, _vfloat(j1), b1)
        a2 = _vfma(d * s2, _vfloat(i2), a2)
        b2 = _vfma(e * s2, _vfloat(j2), b2)
        a3 = _vfma(d * s3, _vfloat(i3), a3)
        b3 = _vfma(e * s3, _vfloat(j3), b3)
        if qtype == 3 or qtype == 7 or qtype == 12:
            d, e = _vfloats(mn, 32 * g), _vfloats(mn, 32 * g + 16)
            s0, s1 = _vsplat(gm[t, base + g]), _vsplat(gm[t + 1, base + g])
            s2, s3 = _vsplat(gm[t + 2, base + g]), _vsplat(gm[t + 3, base + g])
            a0 = _vfma(d, s0, a0)
            b0 = _vfma(e, s0, b0)
            a1 = _vfma(d, s1, a1)
            b1 = _vfma(e, s1, b1)
            a2 = _vfma(d, s2, a2)
            b2 = _vfma(e, s2, b2)
            a3 = _vfma(d, s3, a3)
            b3 = _vfma(e, s3, b3)
    _outer_store(out, t, r0, a0, b0, more)
    _outer_store(out, t + 1, r0, a1, b1, more)
    _outer_store(out, t + 2, r0, a2, b2, more)
    _outer_store(out, t + 3, r0, a3, b3, more)


@_jit(inline=True)
def _q8_panel1(
    qtype: int,
    xq: np.ndarray,
    gd: np.ndarray,
    gi: np.ndarray,
    gm: np.ndarray,
    t: int,  # one token
    v0: int,
    g0: int,
    g1: int,
    panel: np.ndarray,
    sc: np.ndarray,
    mn: np.ndarray,
    out: np.ndarray,
    r0: int,
    more: bool,
) -> None:  # pragma: no cover - compiled
    """:func:`_q8_panel4` for one token: its sums in the same order."""
    kg = 4 if qtype == 14 else 8
    base = v0 // (4 * kg)
    xt = xq[t, v0:]
    a = b = _vzero()
    for g in range(g0, g1):
        i = j = _vsplat(gi[t, base + g])
        for k in range(kg * g, kg * g + kg):
            s = _bsplat4(xt, 4 * k)
            i = _vdotacc(i, _bint8s(panel, 128 * k), s)
            j = _vdotacc(j, _bint8s(panel, 128 * k + 64), s)
        s0 = _vsplat(gd[t, base + g])
        a = _vfma(_vfloats(sc, 32 * g) * s0, _vfloat(i), a)
        b = _vfma(_vfloats(sc, 32 * g + 16) * s0, _vfloat(j), b)
        if qtype == 3 or qtype == 7 or qtype == 12:
            s0 = _vsplat(gm[t, base + g])
            a = _vfma(_vfloats(mn, 32 * g), s0, a)
            b = _vfma(_vfloats(mn, 32 * g + 16), s0, b)
    _outer_store(out, t, r0, a, b, more)


@_jit()
def _q8_panel_rows(
    qtype: int,
    xq: np.ndarray,
    gd: np.ndarray,
    gi: np.ndarray,
    gm: np.ndarray,
    w: np.ndarray,
    values: int,  # a weight block's
    n: int,  # in_features
    out: np.ndarray,
    start: int,
    stop: int,  # start + a multiple of 32
) -> None:  # pragma: no cover - compiled
    """Rows ``start..stop-1`` for every token, 32 rows a panel."""
    numba.literally(qtype)
    t_len = xq.shape[0]
    group = 16 if qtype == 14 else 32
    chunk = min(n, values * max(1, _Q8_PANEL_CHUNK // values))
    width = 64 * ((chunk + 63) // 64)
    buf = np.zeros((_OUTER_ROWS, width // 4), np.float32)
    flat = buf.reshape(-1)
    rows = buf.view(np.uint8)
    panel = np.empty(8 * width, np.float32)  # 32 rows' bytes
    panel8 = panel.view(np.uint8)
    sc = np.zeros(_OUTER_ROWS * (width // group), np.float32)
    mn = np.zeros(_OUTER_ROWS * (width // group), np.float32)
    step = _Q8_PANEL_K // group
    for r0 in range(start, stop, _OUTER_ROWS):
        for v0 in range(0, n, chunk):
            kn = min(chunk, n - v0)
            _q8_unpack(qtype, w, r0, v0 // values, (v0 + kn) // values, rows, sc, mn)
            words = width // 4
            for half in range(2):
                for kb in range((kn + 63) // 64):
                    _vtranspose16(
                        flat, 16 * (half * words + kb), words,
                        panel, 16 * (kb * _OUTER_ROWS + half), _OUTER_ROWS,
                    )  # fmt: skip
            groups = kn // group
            for g0 in range(0, groups, step):
                g1 = min(groups, g0 + step)
                more = v0 > 0 or g0 > 0
                t = 0
                while t + 4 <= t_len:
                    _q8_panel4(
                        qtype, xq, gd, gi, gm, t, v0, g0, g1,
                        panel8, sc, mn, out, r0, more,
                    )  # fmt: skip
                    t += 4
                while t < t_len:
                    _q8_panel1(
                        qtype, xq, gd, gi, gm, t, v0, g0, g1,
                        panel8, sc, mn, out, r0, more,
                    )  # fmt: skip
                    t += 1


@_jit()
def _q8_panel_route(qtype: int, t_len: int, rows: int) -> bool:  # pragma: no cover
    """Whether a q8 call of ``t_len`` tokens multiplies byte panels."""
    if t_len < _Q8_PANEL_TOKENS or rows < _OUTER_ROWS:
        return False
    return qtype != 8 or _Q8_PANEL_Q8_0


@_jit()
def _matmul_rows(
    x: np.ndarray,  # (T, in) float32
    w: np.ndarray,  # (out_features, row_bytes) uint8
    qtype: int,
    values: int,  # a block's
    out: np.ndarray,  # (T, out_features)
    start: int,  # rows start..stop-1, start a multiple of 4
    stop: int,
    lanes: int,
) -> None:  # pragma: no cover - compiled
    t_len = x.shape[0]
    if t_len == 1 or (t_len <= _GEMV_TOKENS and qtype in _BLOCK_TYPES):
        t = 0
        while t + 4 <= t_len and _GEMV_GROUP >= 4:
            _gemv_tokens(qtype, x, t, 4, w, out, start, stop)
            t += 4
        while t + 2 <= t_len:
            _gemv_tokens(qtype, x, t, 2, w, out, start, stop)
            t += 2
        if t < t_len:
            _gemv(qtype, x[t], w, out[t], start, stop)
        return
    n = x.shape[1]
    if t_len >= _OUTER_TOKENS and n % 16 == 0 and stop - start >= _OUTER_ROWS:
        whole = start + _OUTER_ROWS * ((stop - start) // _OUTER_ROWS)
        _outer_rows(x, w, qtype, values, out, start, whole, lanes)
        start = whole  # the last rows, fewer than 32: a quad at a time
    chunk = min(n, _CHUNK)
    # rows 16 floats longer than a chunk: at 1024 (4 KB) apart the micro-
    # kernel's four weight loads measured 0.89x the scalar kernel's speed
    # (576 x 1536), padded 1.01-1.05x
    # a few tokens: a quad's rows at a time in L1; more: a panel in L2
    panel = _ROWS if t_len * chunk <= _TILE_FLOATS else _PANEL
    buf = np.zeros((panel, chunk + 16), np.float32)
    sums = np.empty((4, _ROWS), np.float32)  # (token, row)
    for p0 in range(start, stop, panel):
        prows = min(panel, stop - p0)
        quads = (prows + _ROWS - 1) // _ROWS
        if prows % _ROWS:  # the last rows: no stale weights beside them
            buf[prows : _ROWS * quads] = 0.0
        for c in range((n + chunk - 1) // chunk):
            k0 = c * chunk
            kn = min(chunk, n - k0)
            _fill_quad(
                qtype, w, p0, prows, k0 // values, (k0 + kn) // values, buf, lanes
            )
            for t0 in range(0, t_len, _TILE):
                t1 = min(t_len, t0 + _TILE)
                for q in range(quads):
                    r0 = p0 + _ROWS * q
                    nrows = min(_ROWS, stop - r0)
                    quad = buf[_ROWS * q : _ROWS * q + _ROWS]
                    if kn % 16 == 0:
                        _micro16(x, t0, t1, k0, kn, quad, out, r0, nrows, c > 0, sums)
                    else:  # float rows of any length
                        _micro(x, t0, t1, k0, kn, quad, out, r0, nrows, c > 0, sums)


@_jit(parallel=True)
def _matmul_parallel(
    x: np.ndarray,
    w: np.ndarray,
    qtype: int,
    values: int,
    out: np.ndarray,
    lanes: int,
    parts: int,
) -> None:  # pragma: no cover - compiled
    rows = w.shape[0]
    quads = (rows + _ROWS - 1) // _ROWS
    for p in _prange(parts):
        start = _ROWS * (p * quads // parts)
        stop = min(rows, _ROWS * ((p + 1) * quads // parts))
        _matmul_rows(x, w, qtype, values, out, start, stop, lanes)


# -- Python API -----------------------------------------------------------------

#: the dequantizers' inner trip count, given at run time (see the module doc)
_LANES = 32
#: below this many multiply-adds a call runs on the calling thread. A
#: hand-off to the second thread measured ~2 us with its core free, so
#: splitting pays where one thread's CPU time a call is past ~4 us; the
#: GEMVs do 10-13 G multiply-adds a second a thread (SmolLM2's 576 x 576 at
#: one token: 24-33 us, ``tools/bench_quant_kernels.py --kernels``), so
#: 65536 is ~5 us: every projection of a real model splits, a toy's don't.
#: (With the other core busy a hand-off took 28 us; no rule here can see
#: that, and the engine's thread count is the place to say so.)
_PARALLEL_MIN_WORK = 1 << 16


_U8, _F32 = np.dtype(np.uint8), np.dtype(np.float32)

#: weights whose checks passed, by (id, qtype, out_features, in_features):
#: (a weak reference to the array, its shape, its type). A decode step
#: makes ~121 calls at batch 1, and the checks cost 4 us a call (the enum,
#: the layout, numpy's dtype comparisons) against the kernel's 2 us; an
#: entry leaves with its array (the reference's callback), and a hit is
#: the same array object with the same shape and dtype.
_CHECKED: dict[tuple[int, int, int, int], tuple[Any, tuple[int, ...], Any]] = {}

#: how ``activations="q8"`` runs a type: no kernel, Q8_0/Q8_1 or Q8_K blocks
_Q8_NONE, _Q8_BLOCKS, _Q8_K = 0, 1, 2


def _checked_weight(
    w_raw: np.ndarray, qtype: int, out_features: int, in_features: int
) -> tuple[int, int, int]:
    """:func:`_check_weight`, remembered for the array object: the type's
    number, its values a block and its q8 route (plain ints: an enum's
    hash is a Python call)."""
    key = (id(w_raw), qtype, out_features, in_features)
    entry = _CHECKED.get(key)
    if (
        entry is not None
        and entry[0]() is w_raw
        and w_raw.shape == entry[1]
        and w_raw.dtype is _U8
    ):
        return entry[2]  # type: ignore[no-any-return]
    kind = _check_weight(w_raw, qtype, out_features, in_features)
    route = _Q8_BLOCKS if kind in Q8_TYPES else _Q8_K if kind in Q8K_TYPES else _Q8_NONE
    plan = (int(kind), _LAYOUTS[kind][0], route)

    def forget(_: Any) -> None:
        _CHECKED.pop(key, None)

    try:
        ref = weakref.ref(w_raw, forget)
    except TypeError:  # pragma: no cover - an ndarray takes weak references
        return plan
    _CHECKED[key] = (ref, w_raw.shape, plan)
    return plan


def _check_weight(
    w_raw: np.ndarray, qtype: int, out_features: int, in_features: int
) -> GGMLType:
    try:
        kind = GGMLType(qtype)
    except ValueError:
        raise ValueError(f"qtype {qtype!r} is not a GGML type") from None
    if kind not in MATMUL_TYPES:
        raise ValueError(f"qtype {kind.name} has no kernel here")
    size = row_bytes(kind, in_features)
    if not isinstance(w_raw, np.ndarray) or w_raw.dtype != np.uint8:
        raise ValueError(f"w_raw must be a np.uint8 array, not {_describe(w_raw)}")
    if w_raw.shape != (out_features, size):
        raise ValueError(
            f"w_raw is {w_raw.shape}, not (out_features, row bytes) ="
            f" {(out_features, size)} for {kind.name} rows of {in_features}"
        )
    if not w_raw.flags.c_contiguous:
        raise ValueError("w_raw must be C-contiguous")
    return kind


def _describe(a: object) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} {a.shape}"
    return type(a).__name__


def _check_floats(name: str, a: object, shape: tuple[int, ...] | None) -> np.ndarray:
    if (  # the common case first, each test cheap (no dtype built)
        type(a) is np.ndarray
        and a.dtype is _F32
        and a.ndim == 2
        and (shape is None or a.shape == shape)
        and a.flags.c_contiguous
    ):
        return a
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 2:
        raise ValueError(f"{name} must be a 2-D float32 array, not {_describe(a)}")
    if shape is not None and a.shape != shape:
        raise ValueError(f"{name} is {a.shape}, not {shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return a


def matmul(
    x: np.ndarray,
    w_raw: np.ndarray,
    qtype: int,
    out_features: int,
    in_features: int,
    out: np.ndarray | None = None,
    *,
    threaded: bool | None = None,
    activations: str = "float",
) -> np.ndarray:
    """``x @ W.T`` for ``W`` the ``(out_features, in_features)`` weight that
    ``w_raw`` holds in GGML type ``qtype`` (its raw rows, ``np.uint8
    (out_features, row_bytes(qtype, in_features))``, C-contiguous).

    ``x`` is float32 ``(T, in_features)``, C-contiguous; the result is
    float32 ``(T, out_features)``, written into ``out`` when given (same
    rules). Any ``T``: decode steps and prefill chunks run the same kernel.
    The rows are spread over the threads of :func:`kernels.set_num_threads`
    when the call is big enough to pay for the hand-off; ``threaded``
    forces the choice. Releases the GIL. Raises ValueError, naming the
    argument, for a wrong dtype, shape or layout.

    ``activations="q8"`` quantizes ``x`` to llama.cpp's Q8_0/Q8_1 blocks
    (weights of :data:`Q8_TYPES`) or Q8_K blocks (:data:`Q8K_TYPES`) first
    and multiplies in integers, as llama.cpp does (other types multiply
    float activations): faster at a few tokens, and the result is
    llama.cpp's, not the float product (``"float"``, the default); a
    token's result does not depend on the other tokens of the call.

    A weight's checks are remembered by its array object (the same array,
    shape and dtype skip them; ~1 us of Python a call, not ~3).
    """
    if out is None:
        _check_floats("x", x, None)
        out = np.empty((x.shape[0], out_features), np.float32)
    fn, args = matmul_call(
        x,
        w_raw,
        qtype,
        out_features,
        in_features,
        out,
        threaded=threaded,
        activations=activations,
    )
    fn(*args)
    return out


def matmul_call(
    x: np.ndarray,
    w_raw: np.ndarray,
    qtype: int,
    out_features: int,
    in_features: int,
    out: np.ndarray,
    *,
    threaded: bool | None = None,
    activations: str = "float",
) -> kernels.Call:
    """:func:`matmul` into ``out`` checked and bound to its arrays, not run:
    each call multiplies what ``x`` holds then."""
    if activations not in ("float", "q8"):
        raise ValueError(f"activations must be 'float' or 'q8', not {activations!r}")
    code, values, route = _checked_weight(w_raw, qtype, out_features, in_features)
    _check_floats("x", x, None)
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} columns, not in_features {in_features}")
    _check_floats("out", out, (x.shape[0], out_features))
    if x.shape[0] == 0:
        return _nothing, ()
    w_raw = read_only(w_raw)
    threads = kernels._threads
    if threaded is None:
        threaded = x.size * out_features >= _PARALLEL_MIN_WORK
    split = threaded and threads > 1 and out_features > _ROWS
    parts = min(threads, (out_features + _ROWS - 1) // _ROWS)
    if activations == "q8" and route:
        args8 = (x, w_raw, code, out, parts)
        if split:
            return kernels._threaded, (_matmul8_parallel, _matmul8_serial, args8)
        return _matmul8_serial, args8
    args = (x, w_raw, code, values, out, _LANES, parts)
    if split:
        return kernels._threaded, (_matmul_parallel, _matmul_serial, args)
    return _matmul_serial, args


def _nothing() -> None:
    """The call of a matmul of no rows."""


def _matmul8_serial(*args: Any) -> None:
    """The q8 parallel kernel's arguments, run on the calling thread (its
    first row 0 given at run time: see :func:`_matmul_serial`)."""
    _matmul8(*args[:-1], 0)


def _matmul_serial(*args: Any) -> None:
    """The parallel kernel's arguments, run on the calling thread: the row
    kernel called from Python with its bounds, as the threaded kernel's
    are made at run time (a literal 0 in compiled code would compile every
    kernel under it a second time, specialised for it)."""
    x, w, qtype, values, out, lanes, _ = args
    _matmul_rows(x, w, qtype, values, out, 0, w.shape[0], lanes)


def dequantize_rows(
    w_raw: np.ndarray,
    qtype: int,
    in_features: int,
    start: int = 0,
    stop: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Rows ``start..stop-1`` of the weight ``w_raw`` holds (raw rows of
    GGML type ``qtype``, ``np.uint8 (rows, row_bytes)``) as float32 ``(stop -
    start, in_features)``, into ``out`` when given. Exactly gguf-py's
    ``gguf.quants.dequantize`` (llama.cpp's ``dequantize_row_*``)."""
    rows = w_raw.shape[0] if isinstance(w_raw, np.ndarray) and w_raw.ndim == 2 else 0
    kind = _check_weight(w_raw, qtype, rows, in_features)
    stop = rows if stop is None else stop
    if not 0 <= start <= stop <= rows:
        raise ValueError(f"rows {start}..{stop} out of 0..{rows}")
    shape = (stop - start, in_features)
    if out is None:
        out = np.empty(shape, np.float32)
    else:
        _check_floats("out", out, shape)
    rows_raw = read_only(w_raw[start:stop])
    _dequantize_rows(rows_raw, int(kind), _LAYOUTS[kind][0], out, _LANES)
    return out


def read_only(w_raw: np.ndarray) -> np.ndarray:
    """``w_raw``, or a read-only view of it when it is writable.

    The kernels are compiled for read-only weights alone, as a GGUF file's
    map gives them: numba compiles a kernel once for each array type, and a
    writable array is another type (a second compile of the same code,
    30-40 s a kernel on a cold cache). :class:`~structllm.model.quantized.
    QuantizedPart` keeps its rows read-only, so the engine's calls take no
    view."""
    if not isinstance(w_raw, np.ndarray) or not w_raw.flags.writeable:
        return w_raw  # not an array: the checks name it
    view = w_raw.view()
    view.flags.writeable = False
    return view


def warm_up(*, q8: bool = False) -> None:
    """Compile the kernels (or load them from numba's disk cache), threaded
    too when the engine has threads, so a first step never pauses to
    compile; with ``q8``, the q8-activation kernels too. One call compiles
    every type and every ``T`` (the type and the token count are run-time
    arguments), for every weight: the kernels take read-only ones only
    (:func:`read_only`). Then the IR numba keeps of them is freed
    (:func:`kernels.release_linking_ir`)."""
    if numba is None:  # pragma: no cover
        return
    x = np.zeros((1, 32), np.float32)
    w = np.zeros((8, 34), np.uint8)
    xk = np.zeros((1, 256), np.float32)  # the Q8_K kernels' (Q4_K's and Q6_K's)
    wk = np.zeros((8, 144), np.uint8)
    modes = ("float", "q8") if q8 else ("float",)
    threads = (False, True) if kernels._threads > 1 else (False,)
    for act in modes:
        for threaded in threads:
            matmul(x, w, GGMLType.Q8_0, 8, 32, threaded=threaded, activations=act)
            if act == "q8":
                matmul(
                    xk, wk, GGMLType.Q4_K, 8, 256, threaded=threaded, activations=act
                )
    dequantize_rows(w, GGMLType.Q8_0, 32)
    kernels.release_linking_ir()
