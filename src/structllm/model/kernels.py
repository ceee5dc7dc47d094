"""CPU kernels for paged attention, compiled by numba (no C++ build step).

Paddle has no paged attention for CPU, and building one from its ops costs
two passes over the batch's keys and values a layer: a gather out of the
paged cache into a padded ``(kv_heads, B, K, d)`` tensor, then the batched
matmuls that read it. At batch 16 the gathers alone were 40% of a decode
step (docs/benchmarks.md). These kernels read the cache in place, block by
block through each sequence's block table, with the softmax fused in, so a
decode step reads each cached key and value once, in one call a layer.
A second kernel takes the fused q/k/v projection as it leaves the matmul
and does the rest of the attention's input work in one pass: Qwen3's
per-head q/k norm, RoPE, the cache writes.
A third attends a step's prefill chunks over the cache in place too,
their cached prefixes included, with the rows of a tile as the lanes of
16-float vectors (:func:`prefill_attention`).

The kernels work on numpy views of the Paddle tensors (DLPack, zero copy):
float32, C-contiguous, on the host. :func:`available` says whether numba
imported; without it the portable Paddle-op path in ``attention.py`` runs.
They release the GIL, so the server's event loop runs meanwhile, and
decode attention spreads its (sequence, kv head) pairs over the threads
Paddle was given (:func:`set_num_threads`) when the batch is big enough to
pay for the hand-off, on the OpenMP threads of Paddle's matmuls (see
:func:`_share_paddles_openmp`). Keys and values are requested a block
ahead of their reading (a page of one head each: the CPU's own prefetcher
stops at page boundaries). Compiled code is cached on disk (numba's
``cache=True``: next to this file, or in numba's user cache directory when
that is read-only), so a new process loads it (~0.1 s) instead of
compiling again (a few seconds, once per install).

Arithmetic is float32 with reassociation allowed (``fastmath``): sums are
vectorised, so results differ from Paddle's matmuls in the last bits, as two
BLAS libraries do. The softmax subtracts each row's maximum first.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from structllm.model import vectors

__all__ = [
    "Call",
    "add_rms_norm",
    "add_rms_norm_call",
    "available",
    "decode_attention",
    "num_threads",
    "prefill_attention",
    "prefill_items",
    "rope_and_write",
    "rope_write_attend_call",
    "set_num_threads",
    "swiglu",
    "swiglu_call",
    "warm_up",
    "worth_threading",
    "write_kv",
]

#: numba, or None where it is not installed
numba: Any = vectors.numba

#: a kernel call with its arguments checked and bound, not yet run:
#: ``fn(*args)`` runs it (a decode plan's step, ``model/decode_plan.py``)
Call = tuple[Callable[..., Any], tuple[Any, ...]]


def _share_paddles_openmp() -> bool:
    """Put Paddle's OpenMP runtime (Intel's ``libiomp5``, which MKL's
    matmuls run on) in the process's global symbol scope, so that numba's
    OpenMP layer, linked against GNU's ABI, which ``libiomp5`` also
    exports, runs its loops on the same threads.

    With two runtimes the kernels' second thread lands on the core where
    MKL's worker spins for 200 ms after every matmul, and a threaded decode
    was no faster than a serial one inside a step (docs/benchmarks.md).
    """
    if sys.platform != "linux":  # pragma: no cover
        return False
    spec = importlib.util.find_spec("paddle")
    for location in (spec and spec.submodule_search_locations) or ():
        path = os.path.join(location, "libs", "libiomp5.so")
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                # numba's OpenMP layer itself needs GNU's libgomp to load
                importlib.import_module("numba.np.ufunc.omppool")
            except (OSError, ImportError):  # pragma: no cover
                return False
            return True
    return False  # pragma: no cover - Paddle's CPU wheels ship it


#: how long (ms) an OpenMP worker spins for more work after a parallel
#: region before it sleeps; Intel's default is 200. Inside a step the
#: regions come back to back (gaps of 10-100 us), so 1 ms keeps the
#: hand-offs a spinning thread's; between steps and requests the worker
#: sleeps instead of burning its core. On a VM that spin is not free: the
#: host takes the vCPUs back ~100 ms at a time when both are busy (its
#: steal time), and SmolLM2 Q4_1 at batch 1 had 17-25 steps of ~110 ms in
#: 800 with 200 ms, 6-8 with 1 ms (docs/benchmarks.md). A value in the
#: environment wins; read when the runtime starts (the first parallel region).
OPENMP_BLOCKTIME_MS = "1"
os.environ.setdefault("KMP_BLOCKTIME", OPENMP_BLOCKTIME_MS)

#: whether the kernels' threads are MKL's (see _share_paddles_openmp)
SHARED_OPENMP = False
if numba is not None and "NUMBA_THREADING_LAYER" not in os.environ:
    SHARED_OPENMP = _share_paddles_openmp()
    # Several engines may step in threads of one process (inline executors):
    # only thread pools that take concurrent launches (OpenMP, TBB), never
    # numba's fallback workqueue, which aborts the process on them.
    numba.config.THREADING_LAYER = "omp" if SHARED_OPENMP else "threadsafe"

#: below this many (sequence, kv head) pairs times keys, decode attention
#: runs on the calling thread: handing half to a second thread costs more
#: than it saves. On MKL's spinning threads the hand-off is a few us, and
#: a single stream of 32 tokens already gains; on a pool of numba's own,
#: which must first get a core back from MKL's, only large batches do
#: (docs/benchmarks.md).
_PARALLEL_MIN_WORK = 256 if SHARED_OPENMP else 8192
_threads = 1


def available() -> bool:
    """Whether the compiled kernels can run (numba imported)."""
    return numba is not None


def set_num_threads(n: int) -> None:
    """Threads for the threaded kernels (Paddle's share of the cores).

    Starts numba's thread pool now when there is one to start: on the
    shared OpenMP runtime its start sets the process's OpenMP thread count
    to numba's (all the cores), so it must come before Paddle sets its own
    (``_paddle.set_num_threads`` calls this first). Where numba has no pool
    that takes concurrent launches, the kernels stay on one thread.
    """
    global _threads
    if numba is None:  # pragma: no cover
        return
    _threads = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
    if _threads > 1:
        try:
            numba.get_num_threads()  # starts the pool
        except ValueError as exc:  # pragma: no cover - no OpenMP, no TBB
            if "threading layer" not in str(exc):
                raise
            _threads = 1


def _jit(
    parallel: bool = False, fastmath: Any = True, inline: bool = False
) -> Callable[[Any], Any]:
    """numba's ``njit`` with the kernels' options, cached on disk.

    ``inline``: a helper the entry points call, compiled into each of them
    (numba's ``inline="always"``) rather than called. A called helper is
    not one code: numba links its optimized code into every caller as a
    weak copy that LLVM optimizes again there, and with fast-math the copy
    rounds differently. The process that compiled the helper calls its own
    code; a later one loads the callers from the disk cache and calls the
    copy of whichever it loaded first: other last bits than the first
    process, and other greedy tokens after 30 layers (2026-12). Inlined,
    the code an entry point runs is the code its cache holds. A helper
    with other fast-math flags than its callers (:func:`_exp`) cannot be
    inlined so (it would take theirs); it must be small enough that LLVM
    inlines it everywhere, or exact (the same bits however optimized).
    """

    def compile(f: Any) -> Any:
        if numba is None:  # pragma: no cover
            return f
        options = {
            "nogil": True,
            "fastmath": fastmath,
            "boundscheck": False,
            "parallel": parallel,
            "inline": "always" if inline else "never",
        }
        try:
            kernel = numba.njit(cache=True, **options)(f)
        except RuntimeError:  # pragma: no cover - no writable cache directory
            kernel = numba.njit(**options)(f)  # compiled in every process
        _KERNELS.append(kernel)
        return kernel

    return compile


#: every kernel :func:`_jit` made (``quant_kernels``, ``panel_kernels`` and
#: ``lora_kernels`` make theirs with it): what :func:`release_linking_ir`
#: looks at
_KERNELS: list[Any] = []


def release_linking_ir() -> int:
    """Free the LLVM IR numba holds of the compiled kernels for linking
    them into later compiles; the bytes of bitcode it was parsed from
    (which stay, to be parsed again should a compile link one in).

    numba loads a kernel from its disk cache as machine code plus the
    kernel's module as bitcode, which it parses into LLVM IR at once and
    keeps, in case another function compiled later calls the kernel (it
    keeps such a copy of a kernel it compiled itself, too, from writing
    the cache). No step needs it: SmolLM2's quantized kernels held ~28 MiB
    of the core process's memory as IR, parsed from ~3 MiB of bitcode
    (docs/benchmarks.md). Each library's IR goes once; a kernel loaded
    afterwards has its own freed by the next call (the core calls this
    with :func:`~structllm.engine.child.release_kept_memory`).
    """
    if numba is None:  # pragma: no cover
        return 0
    released = 0
    # numba adds a kernel's overloads under this lock (another engine's
    # thread in this process may be loading one)
    with importlib.import_module("numba.core.compiler_lock").global_compiler_lock:
        for kernel in list(_KERNELS):
            released += sum(map(_release_ir, kernel.overloads.values()))
    return released


def _release_ir(result: Any) -> int:
    """Drop the IR an overload's library keeps for linking; its bitcode's
    bytes (0 where it keeps none)."""
    library = result.library
    ir = getattr(library, "_shared_module", None)
    if ir is None:
        return 0
    bitcode = ir.as_bitcode()
    # numba's one way to the IR (linking, writing the cache)
    library._get_module_for_linking = functools.partial(_parse_bitcode, bitcode)
    library._shared_module = None
    return len(bitcode)


def _parse_bitcode(bitcode: bytes) -> Any:
    """An LLVM module from its bitcode (a kernel's IR, parsed again)."""
    return importlib.import_module("llvmlite.binding").parse_bitcode(bitcode)


#: a parallel loop where compiled with parallel=True, else a plain range
_prange = range if numba is None else numba.prange


def _load(x: Any) -> Any:  # pragma: no cover - compiled through the overload
    """A cache element as float32 (see :data:`CACHE_BITS`: a bfloat16 or a
    float16 cache holds its elements' bits)."""
    return x


def _store(x: Any, cache: np.ndarray) -> Any:  # pragma: no cover - likewise
    """A float32 value as ``cache`` holds it, rounded to nearest even (as
    ``torch``, Paddle and numpy round)."""
    return x


#: how a 16-bit cache's elements reach the kernels: numba has no bfloat16
#: nor (on the CPU) float16, so a cache of either is seen as its bits, told
#: apart by the integer type (``attention._host_array`` views them so)
CACHE_BITS = {"bfloat16": np.uint16, "float16": np.int16}


def _half_to_float_intrinsic(typingctx: Any, bits: Any) -> Any:
    """float16 bits (int16) as float32: one ``vcvtph2ps``."""
    ir = importlib.import_module("llvmlite.ir")

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return numba.types.float32(bits), codegen


def _float_to_half_intrinsic(typingctx: Any, x: Any) -> Any:
    """A float32 as float16 bits (int16), rounded to nearest even: one
    ``vcvtps2ph``."""
    ir = importlib.import_module("llvmlite.ir")

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        x = context.cast(builder, args[0], signature.args[0], numba.types.float32)
        half = builder.fptrunc(x, ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))

    return numba.types.int16(x), codegen


# numba wants an overload's implementations to carry its exact parameters,
# annotations included


def _load_overload(x: Any) -> Any:
    def from_bfloat16(x: Any) -> Any:
        return np.uint32(np.uint32(x) << 16).view(np.float32)

    def from_float16(x: Any) -> Any:
        return _half_to_float(x)

    def same(x: Any) -> Any:
        return x

    if x == numba.types.uint16:
        return from_bfloat16
    return from_float16 if x == numba.types.int16 else same


def _store_overload(x: Any, cache: Any) -> Any:
    def to_bfloat16(x: Any, cache: Any) -> Any:
        bits = np.float32(x).view(np.uint32)
        if bits & 0x7FFFFFFF > 0x7F800000:  # NaN stays NaN
            return np.uint16((bits >> 16) | 0x40)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        return np.uint16(rounded >> 16)

    def to_float16(x: Any, cache: Any) -> Any:
        return _float_to_half(x)

    def same(x: Any, cache: Any) -> Any:
        return x

    if cache.dtype == numba.types.uint16:
        return to_bfloat16
    return to_float16 if cache.dtype == numba.types.int16 else same


if numba is not None:  # the compiled kernels call _load/_store as these
    _half_to_float = numba.extending.intrinsic(_half_to_float_intrinsic)
    _float_to_half = numba.extending.intrinsic(_float_to_half_intrinsic)
    numba.extending.overload(_load, jit_options={"fastmath": True})(_load_overload)
    numba.extending.overload(_store, jit_options={"fastmath": True})(_store_overload)


# The prefill kernel holds a tile's running sums in registers across the
# keys (or the head), in the 16-lane vectors of ``vectors`` (one type for
# every kernel module; see there why the kernels spell them out).

#: lanes of a vector
_LANES = vectors.LANES
_vzero = vectors.vzero
_vsplat = vectors.vsplat
_vload = vectors.vfloats
_vstore = vectors.vstore
_vcache = vectors.vwiden
_vsum = vectors.vsum
_prefetch = vectors.prefetch


#: blocks of keys and values requested ahead of the one being read: a
#: block of one head is 4 KB (16 slots x 64 float32), a page, and the CPU's
#: own prefetcher stops at page boundaries (docs/benchmarks.md)
_AHEAD = 2


@_jit(inline=True)
def _prefetch_block(
    k_cache: np.ndarray,  # (kvh, S, d)
    v_cache: np.ndarray,
    h: int,
    block: int,  # the block's number in the cache
    block_size: int,
) -> None:  # pragma: no cover - compiled
    d = k_cache.shape[2]
    base = (h * k_cache.shape[1] + block * block_size) * d
    step = 64 // k_cache.itemsize  # elements a cache line
    for offset in range(0, block_size * d, step):
        _prefetch(k_cache, base + offset)
        _prefetch(v_cache, base + offset)


@_jit()
def _write_kv(
    k: np.ndarray,  # (T, kvh, d)
    v: np.ndarray,
    k_cache: np.ndarray,  # (kvh, S, d)
    v_cache: np.ndarray,
    slots: np.ndarray,  # (T,) int64
) -> None:  # pragma: no cover - compiled
    t_len, kvh, d = k.shape
    for t in range(t_len):
        s = slots[t]
        for h in range(kvh):
            for e in range(d):
                k_cache[h, s, e] = _store(k[t, h, e], k_cache)
                v_cache[h, s, e] = _store(v[t, h, e], v_cache)


@_jit(inline=True)
def _rope_and_write(
    qkv: np.ndarray,  # (T, (nh + 2 kvh) d): [q heads | k heads | v heads]
    bias: np.ndarray,  # ((nh + 2 kvh) d,) or (0,): the projection's bias
    positions: np.ndarray,  # (T,) int64
    cos: np.ndarray,  # (max_len, d): [c | c]
    sin: np.ndarray,  # (max_len, d): [-s | s]
    num_heads: int,
    q_norm: np.ndarray,  # (d,) or (0,): Qwen3's per-head RMSNorm weights
    k_norm: np.ndarray,
    eps: float,
    k_cache: np.ndarray,  # (kvh, S, d)
    v_cache: np.ndarray,
    slots: np.ndarray,  # (T,) int64
    q_out: np.ndarray,  # (T, nh, d)
) -> None:  # pragma: no cover - compiled
    t_len = qkv.shape[0]
    kvh, _, d = k_cache.shape
    half = d // 2
    normed = q_norm.shape[0] > 0
    biased = bias.shape[0] > 0
    head = np.empty(d, np.float32)
    for t in range(t_len):
        p = positions[t]
        s = slots[t]
        for hh in range(num_heads + kvh):
            base = hh * d
            for e in range(d):
                head[e] = qkv[t, base + e]
            if biased:
                for e in range(d):
                    head[e] += bias[base + e]
            if normed:
                total = np.float32(0.0)
                for e in range(d):
                    total += head[e] * head[e]
                inv = np.float32(1.0) / np.sqrt(total / d + np.float32(eps))
                w = q_norm if hh < num_heads else k_norm
                for e in range(d):
                    head[e] = head[e] * inv * w[e]
            # x * cos + [x2 | x1] * sin, as llama.py's _apply_rope
            if hh < num_heads:
                for e in range(d):
                    other = head[e + half] if e < half else head[e - half]
                    q_out[t, hh, e] = head[e] * cos[p, e] + other * sin[p, e]
            else:
                h = hh - num_heads
                for e in range(d):
                    other = head[e + half] if e < half else head[e - half]
                    rotated = head[e] * cos[p, e] + other * sin[p, e]
                    k_cache[h, s, e] = _store(rotated, k_cache)
        for h in range(kvh):
            base = (num_heads + kvh + h) * d
            for e in range(d):
                value = (
                    qkv[t, base + e] + bias[base + e] if biased else qkv[t, base + e]
                )
                v_cache[h, s, e] = _store(value, v_cache)


@_jit(inline=True)
def _attend_one(
    bh: int,  # row b = bh // kvh, kv head h = bh % kvh
    q: np.ndarray,  # (B, nh, d)
    k_cache: np.ndarray,  # (kvh, S, d)
    v_cache: np.ndarray,
    tables: np.ndarray,  # (B, max_blocks) int64
    lens: np.ndarray,  # (B,) int64: keys each row sees, the new one included
    window: int,  # 0: all earlier keys; else the last `window` of them
    scale: float,
    block_size: int,
    out: np.ndarray,  # (B, nh, d)
) -> None:  # pragma: no cover - compiled
    """One row's queries of one kv head (its GQA group) over that head's
    cached keys and values, block by block: the scores first, then the
    weighted values, each key and value read once.

    Head sizes of whole vectors over C-contiguous caches take vectors: a
    key's score is one vector of products folded once (the loop over the
    head was left to LLVM, which kept the sum's dependence from element to
    element), and the values are added into a chunk of 4 vectors per
    block of keys, the running sums in registers across the block. Other
    shapes and layouts go element by element."""
    nh, d = q.shape[1], q.shape[2]
    kvh, slots = k_cache.shape[0], k_cache.shape[1]
    size = k_cache.itemsize
    dense = (
        d % _LANES == 0
        and k_cache.strides[2] == size
        and k_cache.strides[1] == d * size
        and k_cache.strides[0] == slots * d * size
        and v_cache.strides[2] == size
        and v_cache.strides[1] == d * size
        and v_cache.strides[0] == slots * d * size
    )
    g_len = nh // kvh
    b = bh // kvh
    h = bh - b * kvh
    n = lens[b]
    start = n - window if 0 < window < n else 0
    keys = n - start
    first, last = start // block_size, (n - 1) // block_size
    for blk in range(first, min(first + _AHEAD, last + 1)):
        _prefetch_block(k_cache, v_cache, h, tables[b, blk], block_size)
    qs = np.empty(g_len * d, np.float32)
    for g in range(g_len):
        for e in range(d):
            qs[g * d + e] = q[b, h * g_len + g, e] * scale
    scores = np.empty((g_len, keys), np.float32)
    for blk in range(first, last + 1):
        if blk + _AHEAD <= last:
            _prefetch_block(k_cache, v_cache, h, tables[b, blk + _AHEAD], block_size)
        lo = max(start, blk * block_size)
        hi = min(n, (blk + 1) * block_size)
        shift = (tables[b, blk] - blk) * block_size  # position + shift: slot
        for g in range(g_len):
            qg = g * d
            for pos in range(lo, hi):
                if dense:
                    at = (h * slots + pos + shift) * d
                    a0 = a1 = _vzero()
                    for c in range(0, d - 2 * _LANES + 1, 2 * _LANES):
                        a0 += _vload(qs, qg + c) * _vcache(k_cache, at + c)
                        a1 += _vload(qs, qg + c + _LANES) * _vcache(
                            k_cache, at + c + _LANES
                        )
                    if d % (2 * _LANES):
                        c = d - _LANES
                        a0 += _vload(qs, qg + c) * _vcache(k_cache, at + c)
                    scores[g, pos - start] = _vsum(a0 + a1)
                else:
                    dot = np.float32(0.0)
                    for e in range(d):
                        dot += qs[qg + e] * _load(k_cache[h, pos + shift, e])
                    scores[g, pos - start] = dot
    inv = np.empty(g_len, np.float32)
    for g in range(g_len):
        row = scores[g]
        top = row[0]
        for j in range(1, keys):
            top = max(top, row[j])
        total = np.float32(0.0)
        for j in range(keys):
            p = _exp(row[j] - top)
            row[j] = p
            total += p
        inv[g] = np.float32(1.0) / total
    acc = np.zeros(g_len * d, np.float32)
    for blk in range(first, last + 1):
        lo = max(start, blk * block_size)
        hi = min(n, (blk + 1) * block_size)
        shift = (tables[b, blk] - blk) * block_size
        for g in range(g_len):
            if not dense:
                for pos in range(lo, hi):
                    p = scores[g, pos - start]
                    for e in range(d):
                        acc[g * d + e] += p * _load(v_cache[h, pos + shift, e])
                continue
            for c in range(0, d - 4 * _LANES + 1, 4 * _LANES):
                o = g * d + c
                a0 = _vload(acc, o)
                a1 = _vload(acc, o + _LANES)
                a2 = _vload(acc, o + 2 * _LANES)
                a3 = _vload(acc, o + 3 * _LANES)
                for pos in range(lo, hi):
                    p = _vsplat(scores[g, pos - start])
                    at = (h * slots + pos + shift) * d + c
                    a0 += p * _vcache(v_cache, at)
                    a1 += p * _vcache(v_cache, at + _LANES)
                    a2 += p * _vcache(v_cache, at + 2 * _LANES)
                    a3 += p * _vcache(v_cache, at + 3 * _LANES)
                _vstore(acc, o, a0)
                _vstore(acc, o + _LANES, a1)
                _vstore(acc, o + 2 * _LANES, a2)
                _vstore(acc, o + 3 * _LANES, a3)
            for c in range(d - d % (4 * _LANES), d, _LANES):
                o = g * d + c
                a0 = _vload(acc, o)
                for pos in range(lo, hi):
                    p = _vsplat(scores[g, pos - start])
                    at = (h * slots + pos + shift) * d + c
                    a0 += p * _vcache(v_cache, at)
                _vstore(acc, o, a0)
    for g in range(g_len):
        for e in range(d):
            out[b, h * g_len + g, e] = acc[g * d + e] * inv[g]


# Two entry points, each its own function: numba's disk cache keys compiled
# code by function and signature, not by compile options, so a serial and a
# parallel compile of one function would load each other's code.


@_jit()
def _decode_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    tables: np.ndarray,
    lens: np.ndarray,
    window: int,
    scale: float,
    block_size: int,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    for bh in range(q.shape[0] * k_cache.shape[0]):
        _attend_one(
            bh, q, k_cache, v_cache, tables, lens, window, scale, block_size, out
        )


@_jit(parallel=True)
def _decode_attention_parallel(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    tables: np.ndarray,
    lens: np.ndarray,
    window: int,
    scale: float,
    block_size: int,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    for bh in _prange(q.shape[0] * k_cache.shape[0]):
        _attend_one(
            bh, q, k_cache, v_cache, tables, lens, window, scale, block_size, out
        )


@_jit()
def _rope_write_attend(
    qkv: np.ndarray,
    bias: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    q_norm: np.ndarray,
    k_norm: np.ndarray,
    eps: float,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    slots: np.ndarray,
    q: np.ndarray,  # (B, nh, d) scratch: the rotated queries
    tables: np.ndarray,
    lens: np.ndarray,
    window: int,
    scale: float,
    block_size: int,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    _rope_and_write(
        qkv, bias, positions, cos, sin, q.shape[1], q_norm, k_norm, eps,
        k_cache, v_cache, slots, q,
    )  # fmt: skip
    for bh in range(q.shape[0] * k_cache.shape[0]):
        _attend_one(
            bh, q, k_cache, v_cache, tables, lens, window, scale, block_size, out
        )


@_jit(parallel=True)
def _rope_write_attend_parallel(
    qkv: np.ndarray,
    bias: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    q_norm: np.ndarray,
    k_norm: np.ndarray,
    eps: float,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    slots: np.ndarray,
    q: np.ndarray,
    tables: np.ndarray,
    lens: np.ndarray,
    window: int,
    scale: float,
    block_size: int,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    _rope_and_write(
        qkv, bias, positions, cos, sin, q.shape[1], q_norm, k_norm, eps,
        k_cache, v_cache, slots, q,
    )  # fmt: skip
    for bh in _prange(q.shape[0] * k_cache.shape[0]):
        _attend_one(
            bh, q, k_cache, v_cache, tables, lens, window, scale, block_size, out
        )


# every fast-math flag but reassociation, which would fold the two halves
# of ln2 back into one and lose the reduction's precision
@_jit(fastmath={"nnan", "ninf", "nsz", "arcp", "contract", "afn"})
def _exp(x: float) -> Any:  # pragma: no cover - compiled
    """``exp(x)`` in float32 for the softmax's ``x <= 0``, as arithmetic a
    loop can vectorise (numba's ``np.exp`` is a libm call per element
    without Intel's SVML). Cephes' ``expf``: ``x = n ln2 + r`` with ``ln2``
    split in two (Cody and Waite), ``|r| <= ln2 / 2``, ``e^r`` by a degree-7
    polynomial, times ``2^n`` built in the exponent bits; within 2 ulp. Below
    -87 (near 2^-126, the smallest normal float) it returns ~1e-38."""
    y = max(np.float32(x), np.float32(-87.0))
    n = np.floor(y * np.float32(1.4426950408889634) + np.float32(0.5))
    r = y - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * np.uint32((np.int32(n) + 127) << 23).view(np.float32)


@_jit(inline=True)
def _slot(table: np.ndarray, pos: int, block_size: int) -> Any:  # pragma: no cover
    """Position ``pos``'s slot under a block table."""
    return table[pos // block_size] * block_size + pos % block_size


#: rows of a prefill tile (a chunk's rows are its tokens times the GQA
#: group, token-major; a last tile is padded with zero queries): three
#: vectors, lanes of which are rows
_ROWS = 3 * _LANES


@_jit(inline=True)
def _prefill_tile(
    q: np.ndarray,  # (T, nh, d) rotated
    k_cache: np.ndarray,  # (kvh, S, d)
    v_cache: np.ndarray,
    table: np.ndarray,  # (max_blocks,) int64: the chunk's block table
    start: int,  # the chunk's first row of q, at position `context`
    stop: int,
    context: int,
    h: int,  # the kv head
    r0: int,  # the tile's first row of the chunk's (stop - start) g
    window: int,  # 0: all earlier keys; else the last `window` of them
    scale: float,
    block_size: int,
    qt: np.ndarray,  # (d _ROWS,) scratch: the queries, head-major (qt[e, r])
    st: np.ndarray,  # (keys _ROWS,) scratch: the scores, key-major (st[j, r])
    ot: np.ndarray,  # (d _ROWS,) scratch: the outputs, head-major
    best: np.ndarray,  # (_ROWS,) float32 scratch
    total: np.ndarray,  # (_ROWS,) float32 scratch
    seen: np.ndarray,  # (2, _ROWS) int64 scratch: each row's keys, lo..hi-1
    slots: np.ndarray,  # (keys,) int64 scratch
    out: np.ndarray,  # (T, nh, d)
) -> None:  # pragma: no cover - compiled
    """The tile of a prefill chunk's rows ``r0..r0 + _ROWS - 1`` of kv head
    ``h``: row ``i`` is the chunk's token ``i // g``, its query head ``h g
    + i % g``. The tile attends over the keys it sees, from its first
    token's window to its last token's own.

    The rows are the vectors' lanes, so nothing is summed across lanes:
    scores are 3 vectors of rows x 4 keys of running sums along the head
    (12 registers; a key's element is one broadcast), the softmax runs
    down the keys a vector of rows at a time, and the outputs are 3
    vectors of rows x 4 head elements of sums along the keys. Keys and
    values are read in place, each element broadcast once a tile."""
    nh, d = q.shape[1], q.shape[2]
    g = nh // k_cache.shape[0]
    rows = min(_ROWS, (stop - start) * g - r0)
    first = context + r0 // g  # the tile's first token's position
    lo = max(0, first - window + 1) if window > 0 else 0  # key j is at lo + j
    keys = context + (r0 + rows - 1) // g + 1 - lo
    for j in range(keys):
        slots[j] = _slot(table, lo + j, block_size)
    for r in range(_ROWS):
        if r < rows:
            token = (r0 + r) // g
            pos = context + token
            seen[0, r] = max(0, pos - window + 1) - lo if window > 0 else 0
            seen[1, r] = pos + 1 - lo
            src = q[start + token, h * g + (r0 + r) % g]
            for e in range(d):
                qt[e * _ROWS + r] = src[e]
        else:  # padding: no keys, zero queries
            seen[0, r] = seen[1, r] = 0
            for e in range(d):
                qt[e * _ROWS + r] = 0.0
    # scores, 4 keys at a time
    j = 0
    while j + 4 <= keys:
        k0, k1 = k_cache[h, slots[j]], k_cache[h, slots[j + 1]]
        k2, k3 = k_cache[h, slots[j + 2]], k_cache[h, slots[j + 3]]
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = _vzero()
        for e in range(d):
            base = e * _ROWS
            u = _vload(qt, base)
            v = _vload(qt, base + _LANES)
            w = _vload(qt, base + 2 * _LANES)
            x = _vsplat(_load(k0[e]))
            a0 += u * x
            b0 += v * x
            c0 += w * x
            x = _vsplat(_load(k1[e]))
            a1 += u * x
            b1 += v * x
            c1 += w * x
            x = _vsplat(_load(k2[e]))
            a2 += u * x
            b2 += v * x
            c2 += w * x
            x = _vsplat(_load(k3[e]))
            a3 += u * x
            b3 += v * x
            c3 += w * x
        base = j * _ROWS
        _vstore(st, base, a0)
        _vstore(st, base + _LANES, b0)
        _vstore(st, base + 2 * _LANES, c0)
        base += _ROWS
        _vstore(st, base, a1)
        _vstore(st, base + _LANES, b1)
        _vstore(st, base + 2 * _LANES, c1)
        base += _ROWS
        _vstore(st, base, a2)
        _vstore(st, base + _LANES, b2)
        _vstore(st, base + 2 * _LANES, c2)
        base += _ROWS
        _vstore(st, base, a3)
        _vstore(st, base + _LANES, b3)
        _vstore(st, base + 2 * _LANES, c3)
        j += 4
    while j < keys:
        k0 = k_cache[h, slots[j]]
        a0 = b0 = c0 = _vzero()
        for e in range(d):
            base = e * _ROWS
            x = _vsplat(_load(k0[e]))
            a0 += _vload(qt, base) * x
            b0 += _vload(qt, base + _LANES) * x
            c0 += _vload(qt, base + 2 * _LANES) * x
        base = j * _ROWS
        _vstore(st, base, a0)
        _vstore(st, base + _LANES, b0)
        _vstore(st, base + 2 * _LANES, c0)
        j += 1
    # each row's softmax over its keys, zero at the others (unnormalised:
    # the outputs are divided by the sums)
    row_lo, row_hi = seen[0], seen[1]
    best[:] = -np.inf
    for j in range(keys):
        s = st[j * _ROWS : (j + 1) * _ROWS]
        for r in range(_ROWS):
            if row_lo[r] <= j < row_hi[r]:
                best[r] = max(best[r], s[r])
    for r in range(_ROWS):
        if row_lo[r] == row_hi[r]:
            best[r] = 0.0
    total[:] = 0.0
    sc = np.float32(scale)
    for j in range(keys):
        s = st[j * _ROWS : (j + 1) * _ROWS]
        for r in range(_ROWS):
            p = _exp((s[r] - best[r]) * sc)
            p = p if row_lo[r] <= j < row_hi[r] else np.float32(0.0)
            s[r] = p
            total[r] += p
    # outputs, 4 head elements at a time
    e = 0
    while e + 4 <= d:
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = _vzero()
        for j in range(keys):
            vj = v_cache[h, slots[j]]
            base = j * _ROWS
            u = _vload(st, base)
            v = _vload(st, base + _LANES)
            w = _vload(st, base + 2 * _LANES)
            x = _vsplat(_load(vj[e]))
            a0 += u * x
            b0 += v * x
            c0 += w * x
            x = _vsplat(_load(vj[e + 1]))
            a1 += u * x
            b1 += v * x
            c1 += w * x
            x = _vsplat(_load(vj[e + 2]))
            a2 += u * x
            b2 += v * x
            c2 += w * x
            x = _vsplat(_load(vj[e + 3]))
            a3 += u * x
            b3 += v * x
            c3 += w * x
        base = e * _ROWS
        _vstore(ot, base, a0)
        _vstore(ot, base + _LANES, b0)
        _vstore(ot, base + 2 * _LANES, c0)
        base += _ROWS
        _vstore(ot, base, a1)
        _vstore(ot, base + _LANES, b1)
        _vstore(ot, base + 2 * _LANES, c1)
        base += _ROWS
        _vstore(ot, base, a2)
        _vstore(ot, base + _LANES, b2)
        _vstore(ot, base + 2 * _LANES, c2)
        base += _ROWS
        _vstore(ot, base, a3)
        _vstore(ot, base + _LANES, b3)
        _vstore(ot, base + 2 * _LANES, c3)
        e += 4
    while e < d:
        a0 = b0 = c0 = _vzero()
        for j in range(keys):
            x = _vsplat(_load(v_cache[h, slots[j], e]))
            base = j * _ROWS
            a0 += _vload(st, base) * x
            b0 += _vload(st, base + _LANES) * x
            c0 += _vload(st, base + 2 * _LANES) * x
        base = e * _ROWS
        _vstore(ot, base, a0)
        _vstore(ot, base + _LANES, b0)
        _vstore(ot, base + 2 * _LANES, c0)
        e += 1
    for r in range(rows):
        inv = np.float32(1.0) / total[r]
        dst = out[start + (r0 + r) // g, h * g + (r0 + r) % g]
        for e in range(d):
            dst[e] = ot[e * _ROWS + r] * inv


@_jit(inline=True)
def _prefill_part(
    part: int,  # this thread's share of the items (see below)
    parts: int,
    q: np.ndarray,  # (T, nh, d)
    k_cache: np.ndarray,  # (kvh, S, d)
    v_cache: np.ndarray,
    chunks: np.ndarray,  # (P, 3) int64: first row, end row, context
    tables: np.ndarray,  # (P, max_blocks) int64
    items: np.ndarray,  # (W, 3) int64: chunk, kv head, first row; costliest first
    window: int,
    scale: float,
    block_size: int,
    out: np.ndarray,  # (T, nh, d)
) -> None:  # pragma: no cover - compiled
    """A share of a step's prefill tiles, dealt to the parts in a snake
    (0, 1, 1, 0, 0, 1, ... for two) so that each gets costly and cheap ones
    alike."""
    d = q.shape[2]
    width = 0  # the most keys a tile sees
    for c in range(chunks.shape[0]):
        width = max(width, chunks[c, 2] + chunks[c, 1] - chunks[c, 0])
    qt = np.empty(d * _ROWS, np.float32)
    st = np.empty(width * _ROWS, np.float32)
    ot = np.empty(d * _ROWS, np.float32)
    best = np.empty(_ROWS, np.float32)
    total = np.empty(_ROWS, np.float32)
    seen = np.empty((2, _ROWS), np.int64)
    slots = np.empty(width, np.int64)
    for w in range(items.shape[0]):
        turn, at = w // parts, w % parts
        if (at if turn % 2 == 0 else parts - 1 - at) != part:
            continue
        c, h, r0 = items[w, 0], items[w, 1], items[w, 2]
        _prefill_tile(
            q, k_cache, v_cache, tables[c], chunks[c, 0], chunks[c, 1],
            chunks[c, 2], h, r0, window, scale, block_size, qt, st, ot, best,
            total, seen, slots, out,
        )  # fmt: skip


@_jit()
def _prefill_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    chunks: np.ndarray,
    tables: np.ndarray,
    items: np.ndarray,
    window: int,
    scale: float,
    block_size: int,
    out: np.ndarray,
    parts: int,
) -> None:  # pragma: no cover - compiled
    _prefill_part(
        0, 1, q, k_cache, v_cache, chunks, tables, items, window, scale,
        block_size, out,
    )  # fmt: skip


@_jit(parallel=True)
def _prefill_attention_parallel(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    chunks: np.ndarray,
    tables: np.ndarray,
    items: np.ndarray,
    window: int,
    scale: float,
    block_size: int,
    out: np.ndarray,
    parts: int,
) -> None:  # pragma: no cover - compiled
    for part in _prange(parts):
        _prefill_part(
            part, parts, q, k_cache, v_cache, chunks, tables, items, window,
            scale, block_size, out,
        )  # fmt: skip


@_jit()
def _add_rms_norm(
    delta: np.ndarray,  # (T, H) or (0, H): added to x first
    x: np.ndarray,  # (T, H) the residual stream, updated in place
    weight: np.ndarray,  # (H,)
    eps: float,
    normed: np.ndarray,  # (T, H)
) -> None:  # pragma: no cover - compiled
    t_len, hidden = x.shape
    add = delta.shape[0] > 0
    for t in range(t_len):
        row, out = x[t], normed[t]
        if add:
            change = delta[t]
            for e in range(hidden):
                row[e] += change[e]
        total = np.float32(0.0)
        for e in range(hidden):
            total += row[e] * row[e]
        inv = np.float32(1.0) / np.sqrt(total / hidden + np.float32(eps))
        for e in range(hidden):
            out[e] = row[e] * inv * weight[e]


@_jit()
def _swiglu(
    gate_up: np.ndarray,  # (T, 2 I): [gate | up]
    out: np.ndarray,  # (T, I)
) -> None:  # pragma: no cover - compiled
    t_len, inner = out.shape
    for t in range(t_len):
        gate, up, row = gate_up[t, :inner], gate_up[t, inner:], out[t]
        for e in range(inner):
            g = gate[e]
            z = _exp(-abs(g))  # e^-|g| <= 1: sigmoid without overflow
            # np.divide, not /: numba's / checks for a zero divisor, a
            # branch that kept this loop scalar (4-5x its time)
            s = np.divide(np.float32(1.0), np.float32(1.0) + z)
            row[e] = g * (s if g >= 0 else z * s) * up[e]


_NO_NORM = np.zeros(0, np.float32)
_NO_ROWS = np.zeros((0, 0), np.float32)


def _check_slots(slots: np.ndarray, cache: np.ndarray) -> None:
    if slots.size and not (slots.min() >= 0 and slots.max() < cache.shape[1]):
        raise IndexError(f"slot out of range for a cache of {cache.shape[1]}")


def write_kv(
    k: np.ndarray,
    v: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    slots: np.ndarray,
    *,
    checked: bool = False,
) -> None:
    """Store the step's keys and values ``(T, kvh, d)`` at ``slots`` of the
    caches ``(kvh, S, d)``; ``checked``: the caller has range-checked
    ``slots`` (the kernel writes unchecked)."""
    if not checked:
        _check_slots(slots, k_cache)
    _write_kv(k, v, k_cache, v_cache, slots)


def rope_and_write(
    qkv: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    num_heads: int,
    q_norm: np.ndarray | None,
    k_norm: np.ndarray | None,
    eps: float,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    slots: np.ndarray,
    q_out: np.ndarray,
    *,
    bias: np.ndarray | None = None,
    checked: bool = False,
) -> None:
    """From the fused projection ``qkv (T, (nh + 2 kvh) d)``: the rotated
    queries into ``q_out (T, nh, d)``, and the rotated keys and the values
    into the caches at ``slots``.

    ``bias`` (Qwen2) is the projection's, added first. ``cos`` and ``sin``
    are full-width tables (``[c | c]``, ``[-s | s]``) indexed by position;
    ``q_norm``/``k_norm`` (Qwen3) normalise each head before it is rotated.
    ``checked``: the caller has range-checked ``slots`` and ``positions``
    (the kernel reads and writes unchecked).
    """
    if not checked:
        _check_slots(slots, k_cache)
        if positions.size and not (positions.min() >= 0 and positions.max() < len(cos)):
            raise IndexError(f"position out of range for a RoPE table of {len(cos)}")
    if bias is not None and bias.shape != qkv.shape[1:]:
        raise ValueError(f"bias is {bias.shape}, not {qkv.shape[1:]}")
    _rope_and_write(
        qkv,
        _NO_NORM if bias is None else bias,
        positions,
        cos,
        sin,
        num_heads,
        _NO_NORM if q_norm is None else q_norm,
        _NO_NORM if k_norm is None else k_norm,
        eps,
        k_cache,
        v_cache,
        slots,
        q_out,
    )


def num_threads() -> int:
    """The threads the threaded kernels run on (:func:`set_num_threads`)."""
    return _threads


def worth_threading(work: int) -> bool:
    """Whether decode attention of ``work`` (rows x kv heads x keys) runs
    threaded (see ``_PARALLEL_MIN_WORK``); a step decides once."""
    return _threads > 1 and work >= _PARALLEL_MIN_WORK


#: the thread count numba was last given on each calling thread
_numba_threads = threading.local()


def decode_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    tables: np.ndarray,
    lens: np.ndarray,
    window: int | None,
    scale: float,
    block_size: int,
    out: np.ndarray | None = None,
    *,
    threaded: bool | None = None,
) -> np.ndarray:
    """One query a row, ``q (B, nh, d)``, over its sequence's cached keys.

    Row ``b`` sees positions ``0..lens[b]-1`` (its own key, written before,
    is the last), or only the last ``window`` of them, through the block
    table ``tables[b]``. Returns ``(B, nh, d)`` (written into ``out`` if
    given: float32, C-contiguous, of that shape). The caller checks that
    ``tables`` covers ``lens`` and stays inside the cache: the kernel reads
    unchecked. ``threaded``: spread the rows over the threads, as
    :func:`worth_threading` said for this step (None: decide here).
    """
    if out is None:
        out = np.empty(q.shape, np.float32)
    elif out.shape != q.shape:
        raise ValueError(f"out is {out.shape}, not {q.shape}")
    args = (q, k_cache, v_cache, tables, lens, window or 0, scale, block_size, out)
    if threaded is None:
        threaded = worth_threading(
            len(lens) * k_cache.shape[0] * int(lens.max(initial=0))
        )
    if threaded and _threads > 1:
        _threaded(_decode_attention_parallel, _decode_attention, args)
    else:
        _decode_attention(*args)
    return out


def rope_write_attend_call(
    qkv: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    q_norm: np.ndarray | None,
    k_norm: np.ndarray | None,
    eps: float,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    slots: np.ndarray,
    q: np.ndarray,
    tables: np.ndarray,
    lens: np.ndarray,
    window: int | None,
    scale: float,
    block_size: int,
    out: np.ndarray,
    *,
    bias: np.ndarray | None = None,
    threaded: bool = False,
) -> Call:
    """A step of decode rows' whole attention from their fused projection
    ``qkv (B, (nh + 2 kvh) d)`` in one call: :func:`rope_and_write` (the
    rotated queries into the scratch ``q (B, nh, d)``), then
    :func:`decode_attention` into ``out (B, nh, d)``, the same arithmetic.
    One call instead of two a layer: each costs several microseconds of
    Python and argument checks in the middle of a step. The caller has
    range-checked ``slots``, ``positions`` and ``tables`` (the kernels
    read and write unchecked). ``threaded``: the attention spreads its
    rows over the threads (the writes stay on the calling thread), as
    :func:`worth_threading` said for this step. Returned as a call bound to
    its arrays, not run (a decode plan's: ``fn(*args)``), which reads what
    they hold when it runs."""
    if out.shape != q.shape or q.shape[0] != qkv.shape[0]:
        raise ValueError(f"out {out.shape} and q {q.shape} for qkv {qkv.shape}")
    if bias is not None and bias.shape != qkv.shape[1:]:
        raise ValueError(f"bias is {bias.shape}, not {qkv.shape[1:]}")
    args = (
        qkv, _NO_NORM if bias is None else bias, positions, cos, sin,
        _NO_NORM if q_norm is None else q_norm,
        _NO_NORM if k_norm is None else k_norm,
        eps, k_cache, v_cache, slots, q, tables, lens, window or 0, scale,
        block_size, out,
    )  # fmt: skip
    if threaded and _threads > 1:
        return _threaded, (_rope_write_attend_parallel, _rope_write_attend, args)
    return _rope_write_attend, args


def _threaded(kernel: Any, serial: Any, args: tuple[Any, ...]) -> None:
    """``kernel(*args)`` on ``_threads`` threads; ``serial(*args)`` where
    numba has no thread pool that takes concurrent launches."""
    try:
        if getattr(_numba_threads, "n", 0) != _threads:
            numba.set_num_threads(_threads)  # per calling thread
            _numba_threads.n = _threads
        kernel(*args)
    except ValueError as exc:  # pragma: no cover - no OpenMP, no TBB
        if "threading layer" not in str(exc):
            raise
        set_num_threads(1)
        serial(*args)


def prefill_items(chunks: np.ndarray, num_heads: int, num_kv_heads: int) -> np.ndarray:
    """The work items of a step's prefill chunks ``chunks (P, 3)`` (first
    row, end row, context) for :func:`prefill_attention`: ``(W, 3)`` int64,
    (chunk, kv head, first row of a tile), costliest first (the most keys a
    tile's tokens see, a window aside) so that the threads' shares even out.
    A chunk's rows are its tokens times the GQA group, ``_ROWS`` a tile.
    Once a step: every layer's are the same."""
    g = num_heads // num_kv_heads
    work = [
        (context + (min(r0 + _ROWS, (stop - start) * g) - 1) // g + 1, c, h, r0)
        for c, (start, stop, context) in enumerate(chunks.tolist())
        for r0 in range(0, (stop - start) * g, _ROWS)
        for h in range(num_kv_heads)
    ]
    if not work:
        return np.zeros((0, 3), np.int64)
    table = np.array(work, np.int64)
    return np.ascontiguousarray(table[np.argsort(-table[:, 0], kind="stable"), 1:])


def prefill_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    chunks: np.ndarray,
    tables: np.ndarray,
    items: np.ndarray,
    window: int | None,
    scale: float,
    block_size: int,
    out: np.ndarray,
    *,
    threaded: bool = False,
) -> np.ndarray:
    """A step's prefill chunks' attention, ``q (T, nh, d)`` over the cache
    in place into ``out (T, nh, d)`` (only the chunks' rows are written).

    Chunk ``c`` is rows ``chunks[c, 0]..chunks[c, 1]-1`` of ``q``, at
    positions from ``chunks[c, 2]`` (its cached prefix) on, its keys read
    through ``tables[c]``; its keys and values are in the cache already.
    Each row sees the keys up to its own position (only the last ``window``
    with one). ``items`` is :func:`prefill_items` of ``chunks``. The caller
    checks that each table covers its chunk and stays inside the cache: the
    kernel reads unchecked. ``threaded``: deal the items to the threads.
    Returns ``out``.
    """
    if out.shape != q.shape:
        raise ValueError(f"out is {out.shape}, not {q.shape}")
    if len(chunks) and (chunks[:, 0].min() < 0 or chunks[:, 1].max() > len(q)):
        raise IndexError(f"a prefill chunk's rows are outside the {len(q)} rows")
    parts = _threads if threaded and _threads > 1 else 1
    args = (
        q, k_cache, v_cache, chunks, tables, items, window or 0, scale,
        block_size, out, parts,
    )  # fmt: skip
    if parts > 1:
        _threaded(_prefill_attention_parallel, _prefill_attention, args)
    else:
        _prefill_attention(*args)
    return out


def add_rms_norm(
    x: np.ndarray,
    weight: np.ndarray,
    eps: float,
    normed: np.ndarray,
    delta: np.ndarray | None = None,
) -> np.ndarray:
    """``x += delta`` in place (when given), then ``normed = x /
    rms(x) * weight`` row by row (all ``(T, H)`` float32, C-contiguous):
    the residual add and the RMSNorm after it, as Paddle's
    ``fused_rms_norm(residual=)``. Returns ``normed``."""
    fn, args = add_rms_norm_call(x, weight, eps, normed, delta)
    fn(*args)
    return normed


def add_rms_norm_call(
    x: np.ndarray,
    weight: np.ndarray,
    eps: float,
    normed: np.ndarray,
    delta: np.ndarray | None = None,
) -> Call:
    """:func:`add_rms_norm` checked and bound to its arrays, not run."""
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"delta is {delta.shape}, not {x.shape}")
    if normed.shape != x.shape or weight.shape != x.shape[1:]:
        raise ValueError(
            f"normed {normed.shape} or weight {weight.shape} for {x.shape}"
        )
    return _add_rms_norm, (_NO_ROWS if delta is None else delta, x, weight, eps, normed)


def swiglu(gate_up: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``silu(gate) * up`` of ``gate_up (T, 2 I) = [gate | up]`` into ``out
    (T, I)``, as Paddle's ``swiglu`` of one input. Returns ``out``."""
    fn, args = swiglu_call(gate_up, out)
    fn(*args)
    return out


def swiglu_call(gate_up: np.ndarray, out: np.ndarray) -> Call:
    """:func:`swiglu` checked and bound to its arrays, not run."""
    if gate_up.shape != (out.shape[0], 2 * out.shape[1]):
        raise ValueError(f"gate_up is {gate_up.shape}, out {out.shape}")
    return _swiglu, (gate_up, out)


def warm_up(kv_cache_dtype: str = "float32") -> None:
    """Compile the kernels an engine will call, or load them from the disk
    cache: for its cache's dtype, and the threaded decode if it has more
    than one thread. A server's first large batch then never pauses to
    compile. Then the IR numba keeps of them is freed
    (:func:`release_linking_ir`)."""
    if numba is None:  # pragma: no cover
        return
    q = np.zeros((1, 1, 2), np.float32)
    tables, lens = np.zeros((1, 1), np.int64), np.ones(1, np.int64)
    slots = np.zeros(1, np.int64)  # slot 0, position 0
    rope = np.zeros((1, 2), np.float32)
    cache = np.zeros((1, 4, 2), CACHE_BITS.get(kv_cache_dtype, np.float32))
    out = np.empty_like(q)
    _decode_attention(q, cache, cache, tables, lens, 0, 1.0, 4, out)
    if _threads > 1:
        args = (q, cache, cache, tables, lens, 0, 1.0, 4, out)
        _threaded(_decode_attention_parallel, _decode_attention, args)
    _write_kv(q, q, cache, cache, slots)
    qkv = np.zeros((1, 6), np.float32)  # one head each of q, k, v
    fused = (
        qkv, _NO_NORM, slots, rope, rope, _NO_NORM, _NO_NORM, 1e-6, cache,
        cache, slots, out.copy(), tables, lens, 0, 1.0, 4, out,
    )  # fmt: skip
    _rope_write_attend(*fused)
    if _threads > 1:
        _threaded(_rope_write_attend_parallel, _rope_write_attend, fused)
    _rope_and_write(
        qkv,
        _NO_NORM,
        slots,
        rope,
        rope,
        1,
        _NO_NORM,
        _NO_NORM,
        1e-6,
        cache,
        cache,
        slots,
        out,
    )
    chunks = np.array([[0, 1, 0]], np.int64)  # one row at position 0
    items = prefill_items(chunks, 1, 1)
    prefill = (q, cache, cache, chunks, tables, items, 0, 1.0, 4, out, 1)
    _prefill_attention(*prefill)
    if _threads > 1:
        parallel = (*prefill[:-1], _threads)
        _threaded(_prefill_attention_parallel, _prefill_attention, parallel)
    rows = np.zeros((1, 2), np.float32)
    _add_rms_norm(_NO_ROWS, rows, rows[0], 1e-6, rows)
    _add_rms_norm(rows, rows, rows[0], 1e-6, rows)
    _swiglu(np.zeros((1, 4), np.float32), rows)
    release_linking_ir()
