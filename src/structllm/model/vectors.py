"""16-lane vectors for the compiled kernels: one type for all of them.

The kernels hold their running sums in registers, across a GEMV's row, an
attention tile's keys or a prefill tile's head. LLVM's loop vectoriser
cannot be led there from numba (an accumulator array stays in memory, each
update a load and a store, and 32 scalar sums defeat the SLP vectoriser),
so the kernels spell their vectors out: a numba type whose value is an LLVM
``<16 x float>`` (:data:`FLOAT`) or ``<16 x i32>`` (:data:`INT`), loads,
stores and splats as intrinsics, arithmetic through the Python operators
(fast-math for floats: a multiply-add contracts to an FMA). LLVM lowers
them to what the host has (two ymm on AVX2, one zmm on AVX-512).

``kernels`` (attention) and ``quant_kernels`` (the quantized matmuls, which
add their byte vectors for q8 activations) both take theirs from here: one
type means one set of operator overloads, which numba would otherwise have
to choose between. The functions below are stubs for Python's eyes; the
compiled kernels call the intrinsics registered in their place.
"""

from __future__ import annotations

import importlib
import operator
from typing import Any

import numpy as np

__all__ = [
    "FLOAT",
    "INT",
    "LANES",
    "intrinsic",
    "module_class",
    "prefetch",
    "splat",
    "vbf16s",
    "vbytes",
    "vfloat",
    "vfloats",
    "vhalves",
    "vint8s",
    "vsplat",
    "vstore",
    "vsum",
    "vwiden",
    "vzero",
]

numba: Any
try:
    numba = importlib.import_module("numba")
except ImportError:  # pragma: no cover - numba comes with the cpu extra
    numba = None

#: lanes of a vector
LANES = 16

#: the numba types of a float and an int32 vector (None without numba)
FLOAT: Any = None
INT: Any = None


def vzero() -> Any:  # pragma: no cover - compiled
    """A float vector of zeros."""


def vsplat(value: Any) -> Any:  # pragma: no cover - compiled
    """A float (from a float) or int32 (from an integer) vector of ``value``."""


def vfloats(a: np.ndarray, index: int) -> Any:  # pragma: no cover - compiled
    """The 16 float32 ``a.flat[index:index + 16]`` (C-contiguous ``a``)."""


def vstore(a: np.ndarray, index: int, v: Any) -> None:  # pragma: no cover
    """Write a float vector to the float32 ``a.flat[index:index + 16]``."""


def vwiden(a: np.ndarray, index: int) -> Any:  # pragma: no cover - compiled
    """The 16 elements ``a.flat[index:index + 16]`` as float32: float32 as
    they are, a 16-bit KV cache's bits widened (``uint16`` holds bfloat16,
    ``int16`` float16, as ``kernels.CACHE_BITS`` says)."""


def vbytes(row: np.ndarray, index: int) -> Any:  # pragma: no cover - compiled
    """The 16 bytes ``row[index:index + 16]`` as int32 (zero-extended)."""


def vint8s(row: np.ndarray, index: int) -> Any:  # pragma: no cover - compiled
    """The 16 bytes ``row[index:index + 16]`` as int32 (sign-extended)."""


def vhalves(row: np.ndarray, index: int) -> Any:  # pragma: no cover - compiled
    """The 16 IEEE halves at bytes ``row[index:index + 32]`` as float32."""


def vbf16s(row: np.ndarray, index: int) -> Any:  # pragma: no cover - compiled
    """The 16 bfloat16 at bytes ``row[index:index + 32]`` as float32."""


def vfloat(v: Any) -> Any:  # pragma: no cover - compiled
    """An int32 vector as float32."""


def vsum(v: Any) -> float:  # pragma: no cover - compiled
    """The sum of a float vector's lanes (halves folded onto each other)."""
    return 0.0


def prefetch(a: np.ndarray, index: int) -> None:  # pragma: no cover - compiled
    """Ask the CPU for the cache line of ``a.flat[index]`` ahead of its use
    (LLVM's prefetch: past the end allowed, a prefetch never faults; a
    no-op in Python)."""


def module_class(name: str, base: Any, module: str) -> Any:
    """A class ``module.name``, put in that module's namespace so that it is
    pickled by reference (numba's cache pickles the types of a kernel's
    signature; a class pickled by value comes back as another type, one
    numba has no model for). Built with type(): numba's classes are untyped
    to mypy."""
    kind = type(name, (base,), {"__module__": module, "__qualname__": name})
    setattr(importlib.import_module(module), name, kind)
    return kind


def splat(builder: Any, value: Any, vty: Any) -> Any:
    """LLVM: a vector of type ``vty`` with ``value`` in every lane."""
    ir = importlib.import_module("llvmlite.ir")
    i32 = ir.IntType(32)
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(i32, 0))
    zeros = ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)
    return builder.shuffle_vector(one, undef, zeros)


def intrinsic(result: Any, codegen: Any, arity: int) -> Any:
    """A numba intrinsic of ``arity`` arguments (at most four) whose value is
    of type ``result`` and whose code ``codegen`` emits."""

    # numba reads a typer's parameters: no *args
    def none(typingctx: Any) -> Any:
        return result(), codegen

    def one(typingctx: Any, a: Any) -> Any:
        return result(a), codegen

    def two(typingctx: Any, a: Any, b: Any) -> Any:
        return result(a, b), codegen

    def three(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
        return result(a, b, c), codegen

    def four(typingctx: Any, a: Any, b: Any, c: Any, d: Any) -> Any:
        return result(a, b, c, d), codegen

    typer = (none, one, two, three, four)[arity]
    return numba.extending.intrinsic(typer)


def _define() -> None:
    """Register the vector types, their intrinsics and operators with numba."""
    global FLOAT, INT
    ir = importlib.import_module("llvmlite.ir")
    types = numba.types
    extending = numba.extending
    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    vf32, vi32 = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES)
    fast = ("fast",)

    vectors = []
    for name, vty in (("FloatVector16", vf32), ("IntVector16", vi32)):

        def init(self: Any, dmm: Any, fe_type: Any, vty: Any = vty) -> None:
            extending.models.PrimitiveModel.__init__(self, dmm, fe_type, vty)

        kind = module_class(name, types.Type, __name__)
        base = extending.models.PrimitiveModel
        model = type(name + "Model", (base,), {"__init__": init})
        extending.register_model(kind)(model)
        vectors.append(kind(name=name))
    FLOAT, INT = fvec, ivec = vectors

    def address(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        array = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.gep(array.data, [args[1]])

    def pointer(context: Any, builder: Any, sig: Any, args: Any, elem: Any) -> Any:
        target = ir.VectorType(elem, LANES).as_pointer()
        return builder.bitcast(address(context, builder, sig, args), target)

    def widen(builder: Any, bits: Any, half: bool) -> Any:
        # 16 halves or bfloat16 (as <16 x i16>) to float32
        if half:  # vcvtph2ps
            return builder.fpext(
                builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), vf32
            )
        wide = builder.shl(
            builder.zext(bits, vi32), splat(builder, ir.Constant(i32, 16), vi32)
        )
        return builder.bitcast(wide, vf32)

    def zero(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return ir.Constant(vf32, [0.0] * LANES)

    def floats(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.load(pointer(context, builder, sig, args, f32), align=4)

    def bytes_(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.zext(
            builder.load(pointer(context, builder, sig, args, i8), align=1), vi32
        )

    def int8s(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.sext(
            builder.load(pointer(context, builder, sig, args, i8), align=1), vi32
        )

    def halves(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        bits = builder.load(pointer(context, builder, sig, args, i16), align=1)
        return widen(builder, bits, half=True)

    def bf16s(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        bits = builder.load(pointer(context, builder, sig, args, i16), align=1)
        return widen(builder, bits, half=False)

    def widened(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        dtype = sig.args[0].dtype
        if dtype not in (types.uint16, types.int16):
            return floats(context, builder, sig, args)
        bits = builder.load(pointer(context, builder, sig, args, i16), align=2)
        return widen(builder, bits, half=dtype == types.int16)

    def to_float(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.sitofp(args[0], vf32)

    def total(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        v = args[0]
        width = LANES // 2
        while width:  # halves folded onto each other: log2(16) adds
            mask = [i + width if i < width else i for i in range(LANES)]
            high = builder.shuffle_vector(v, v, ir.Constant(vi32, mask))
            v = builder.fadd(v, high, flags=fast)
            width //= 2
        return builder.extract_element(v, ir.Constant(i32, 0))

    def store(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        builder.store(args[2], pointer(context, builder, sig, args, f32), align=4)
        return context.get_dummy_value()

    def fetch(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        i8p = i8.as_pointer()
        byte = builder.bitcast(address(context, builder, sig, args), i8p)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        cgutils = importlib.import_module("numba.core.cgutils")
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        # a read, kept in every cache level, of data
        builder.call(fn, [byte, *(ir.Constant(i32, k) for k in (0, 3, 1))])
        return context.get_dummy_value()

    def splat_typer(typingctx: Any, value: Any) -> Any:
        if isinstance(value, types.Float):
            target, vty, result = types.float32, vf32, fvec
        elif isinstance(value, types.Integer):
            target, vty, result = types.int32, vi32, ivec
        else:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            cast = context.cast(builder, args[0], sig.args[0], target)
            return splat(builder, cast, vty)

        return result(value), codegen

    g = globals()
    g["vzero"] = intrinsic(fvec, zero, 0)
    g["vsplat"] = extending.intrinsic(splat_typer)
    g["vfloats"] = intrinsic(fvec, floats, 2)
    g["vwiden"] = intrinsic(fvec, widened, 2)
    g["vbytes"] = intrinsic(ivec, bytes_, 2)
    g["vint8s"] = intrinsic(ivec, int8s, 2)
    g["vhalves"] = intrinsic(fvec, halves, 2)
    g["vbf16s"] = intrinsic(fvec, bf16s, 2)
    g["vfloat"] = intrinsic(fvec, to_float, 1)
    g["vsum"] = intrinsic(types.float32, total, 1)
    g["vstore"] = intrinsic(types.none, store, 3)
    g["prefetch"] = intrinsic(types.none, fetch, 2)

    def binary(op: Any, vtype: Any, instruction: str, flags: bool) -> None:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            emit = getattr(builder, instruction)
            return emit(*args, flags=fast) if flags else emit(*args)

        implement = intrinsic(vtype, codegen, 2)

        def overload(a: Any, b: Any) -> Any:
            if a is not vtype or b is not vtype:
                return None

            def apply(a: Any, b: Any) -> Any:  # the typing's argument names
                return implement(a, b)

            return apply

        extending.overload(op)(overload)

    for op, instruction in [
        (operator.add, "fadd"),
        (operator.iadd, "fadd"),
        (operator.sub, "fsub"),
        (operator.mul, "fmul"),
    ]:
        binary(op, fvec, instruction, True)
    for op, instruction in [
        (operator.add, "add"),
        (operator.sub, "sub"),
        (operator.mul, "mul"),
        (operator.and_, "and_"),
        (operator.or_, "or_"),
        (operator.rshift, "lshr"),
        (operator.lshift, "shl"),
    ]:
        binary(op, ivec, instruction, False)


if numba is not None:
    _define()
