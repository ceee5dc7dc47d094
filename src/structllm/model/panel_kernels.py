"""CPU matmul kernels for float32 weights packed as 32-column panels.

A float32 projection of Hugging Face shape ``(out, in)`` is packed once, at
load, into ``ceil(out / 32)`` panels of 32 output columns, each input-major:
``panels[p, 32 k + r] = W[32 p + r, k]`` (the last panel's missing columns
zero). :func:`matmul` multiplies float32 activations ``x (T, in)`` by it
with the quantized kernels' prefill outer product
(``quant_kernels._outer8``, here also for 4 and 2 tokens, and
``_outer1``): each token's input broadcast into two vectors of a panel's
32 sums, up to 8 tokens at a time, 256 inputs of a panel (32 KB, in L1) at
a time. A panel is one stream of memory, so the hardware prefetchers keep
ahead of it at any ``T``.

Why not Paddle's ``matmul`` on the ``(in, out)`` weight (MKL's sgemm): a
decode step at a few rows is the weights streamed from memory once, and
MKL reads them slowly there (2 threads, the 27.8M bench checkpoint's 32
projections, ``tools/bench_panels.py``): on an Intel Xeon 33.7 GB/s at 1
row, 10.3 at 16, where the panels measured 1.3-1.6x its speed below 32
rows and 0.9x from 64; on an AMD EPYC (Zen 4) MKL is far slower (17 GB/s
at 1 row, 4 at 16) and the panels 2.9-7x its speed at every row count, 3-4x
in prefill (docs/benchmarks.md "Packed float32 panels"). Each thread takes
a contiguous run of panels.

Sums are float32 with reassociation allowed, as in ``quant_kernels``: the
result equals numpy's product to rounding, and a token's result does not
depend on the other tokens of the call (every token's lanes add the same
inputs in the same order).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from structllm.model import kernels, quant_kernels

__all__ = ["PANEL", "matmul", "matmul_call", "pack", "unpack", "warm_up"]

_jit = kernels._jit
_prange = kernels._prange
_outer8 = quant_kernels._outer8
_outer1 = quant_kernels._outer1
_outer_store = quant_kernels._outer_store
_vzero = quant_kernels._vzero
_vsplat = quant_kernels._vsplat
_vfloats = quant_kernels._vfloats
_check_floats = quant_kernels._check_floats

#: output columns of a panel: two 16-lane vectors of sums
PANEL = quant_kernels._OUTER_ROWS
#: inputs of a panel multiplied at a time: 32 KB of it, which stays in L1
#: while every token's sums sweep it
_PANEL_K = quant_kernels._OUTER_K
#: tokens multiplied into a run of panels while its rows of ``x`` stay in L2
_TILE = 64
#: panels a tile of tokens sweeps before the next tile: 128 columns
_GROUP = 4
#: below this many multiply-adds a call runs on the calling thread (see
#: ``quant_kernels._PARALLEL_MIN_WORK``)
_PARALLEL_MIN_WORK = 1 << 16


@_jit(inline=True)
def _outer4(
    x: np.ndarray,  # (T, in)
    t: int,  # tokens t..t+3
    k0: int,
    kn: int,
    panel: np.ndarray,  # (>= kn * 32,) the columns' weights, input-major
    out: np.ndarray,  # (T, >= r0 + 32)
    r0: int,
    accumulate: bool,
) -> None:  # pragma: no cover - compiled
    """``quant_kernels._outer8`` for 4 tokens: each lane's sum in the same
    order. 2 to 7 rows (a few concurrent streams) token by token (a pass
    over the panel from L1 each) had taken 1.3-1.8x one row's time."""
    a0 = a1 = a2 = a3 = _vzero()
    b0 = b1 = b2 = b3 = _vzero()
    x0, x1 = x[t, k0 : k0 + kn], x[t + 1, k0 : k0 + kn]
    x2, x3 = x[t + 2, k0 : k0 + kn], x[t + 3, k0 : k0 + kn]
    for k in range(kn):
        u = _vfloats(panel, PANEL * k)
        v = _vfloats(panel, PANEL * k + 16)
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
    _outer_store(out, t, r0, a0, b0, accumulate)
    _outer_store(out, t + 1, r0, a1, b1, accumulate)
    _outer_store(out, t + 2, r0, a2, b2, accumulate)
    _outer_store(out, t + 3, r0, a3, b3, accumulate)


@_jit(inline=True)
def _outer2(
    x: np.ndarray,
    t: int,  # tokens t, t+1
    k0: int,
    kn: int,
    panel: np.ndarray,
    out: np.ndarray,
    r0: int,
    accumulate: bool,
) -> None:  # pragma: no cover - compiled
    """:func:`_outer4` for 2 tokens."""
    a0 = a1 = b0 = b1 = _vzero()
    x0, x1 = x[t, k0 : k0 + kn], x[t + 1, k0 : k0 + kn]
    for k in range(kn):
        u = _vfloats(panel, PANEL * k)
        v = _vfloats(panel, PANEL * k + 16)
        s = _vsplat(x0[k])
        a0 += s * u
        b0 += s * v
        s = _vsplat(x1[k])
        a1 += s * u
        b1 += s * v
    _outer_store(out, t, r0, a0, b0, accumulate)
    _outer_store(out, t + 1, r0, a1, b1, accumulate)


@_jit()
def _panel_sweep(
    x: np.ndarray,  # (T, in) float32
    panel: np.ndarray,  # (in * 32,) one panel
    out: np.ndarray,  # (T, >= r0 + 32)
    r0: int,
    t0: int,
    t1: int,
) -> None:  # pragma: no cover - compiled
    """``out[t0:t1, r0:r0 + 32] = x[t0:t1] @ panel``, ``_PANEL_K`` inputs
    at a time in equal parts."""
    n = x.shape[1]
    parts = (n + _PANEL_K - 1) // _PANEL_K
    step = (n + parts - 1) // parts
    for ks in range(0, n, step):
        kl = min(step, n - ks)
        chunk = panel[PANEL * ks : PANEL * (ks + kl)]
        more = ks > 0
        t = t0
        while t + 8 <= t1:
            _outer8(x, t, ks, kl, chunk, out, r0, more)
            t += 8
        if t + 4 <= t1:
            _outer4(x, t, ks, kl, chunk, out, r0, more)
            t += 4
        if t + 2 <= t1:
            _outer2(x, t, ks, kl, chunk, out, r0, more)
            t += 2
        if t < t1:
            _outer1(x, t, ks, kl, chunk, out, r0, more)


@_jit()
def _panel_rows(
    x: np.ndarray,  # (T, in) float32
    panels: np.ndarray,  # (P, in * 32) float32
    out: np.ndarray,  # (T, out_features)
    start: int,
    stop: int,  # panels start..stop-1
) -> None:  # pragma: no cover - compiled
    t_len = x.shape[0]
    columns = out.shape[1]
    tail = np.empty((0, PANEL), np.float32)
    if PANEL * stop > columns:  # the last panel's columns past the output
        tail = np.empty((t_len, PANEL), np.float32)
    for p0 in range(start, stop, _GROUP):
        p1 = min(stop, p0 + _GROUP)
        for t0 in range(0, t_len, _TILE):
            t1 = min(t_len, t0 + _TILE)
            for p in range(p0, p1):
                r0 = PANEL * p
                if r0 + PANEL <= columns:
                    _panel_sweep(x, panels[p], out, r0, t0, t1)
                else:
                    _panel_sweep(x, panels[p], tail, 0, t0, t1)
                    for t in range(t0, t1):
                        for r in range(columns - r0):
                            out[t, r0 + r] = tail[t, r]


@_jit()
def _matmul(
    x: np.ndarray, panels: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled
    _panel_rows(x, panels, out, 0, panels.shape[0])


@_jit(parallel=True)
def _matmul_parallel(
    x: np.ndarray, panels: np.ndarray, out: np.ndarray, parts: int
) -> None:  # pragma: no cover - compiled
    count = panels.shape[0]
    for q in _prange(parts):
        _panel_rows(x, panels, out, q * count // parts, (q + 1) * count // parts)


def _matmul_serial(*args: Any) -> None:
    """The parallel kernel's arguments, run on the calling thread."""
    _matmul(*args[:-1])


def pack(weight: np.ndarray) -> np.ndarray:
    """A float32 ``(out, in)`` weight (HF layout) as panels, ``float32 (ceil(out
    / 32), in * 32)``: ``panels[p, 32 k + r] = weight[32 p + r, k]``, the
    last panel's columns past ``out`` zero."""
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D (out, in), not {weight.shape}")
    out_features, in_features = weight.shape
    count = -(-out_features // PANEL)
    panels = np.zeros((count, in_features, PANEL), np.float32)
    whole = out_features // PANEL
    # (whole * 32, in) -> (whole, 32, in) -> (whole, in, 32)
    panels[:whole] = (
        weight[: whole * PANEL].reshape(whole, PANEL, in_features).swapaxes(1, 2)
    )
    if whole < count:
        panels[whole, :, : out_features - whole * PANEL] = weight[whole * PANEL :].T
    return panels.reshape(count, in_features * PANEL)


def unpack(panels: np.ndarray, out_features: int) -> np.ndarray:
    """:func:`pack`'s weight back, ``float32 (out, in)``."""
    count, size = panels.shape
    in_features = size // PANEL
    w = panels.reshape(count, in_features, PANEL).swapaxes(1, 2)
    return np.ascontiguousarray(w.reshape(count * PANEL, in_features)[:out_features])


def matmul(
    x: np.ndarray,
    panels: np.ndarray,
    out: np.ndarray,
    *,
    threaded: bool | None = None,
) -> np.ndarray:
    """``x @ W.T`` into ``out`` for ``W`` the weight :func:`pack` made
    ``panels`` of: ``x (T, in)`` and ``out (T, out_features)``, float32 and
    C-contiguous, ``out_features`` within the last panel. The panels are
    spread over the threads of :func:`kernels.set_num_threads` when the
    call is big enough to pay for the hand-off; ``threaded`` forces the
    choice. Releases the GIL. Returns ``out``; a wrong dtype, shape or
    layout raises ValueError naming the array (the compiled kernels trust
    theirs: nothing checks bounds there)."""
    fn, args = matmul_call(x, panels, out, threaded=threaded)
    fn(*args)
    return out


def matmul_call(
    x: np.ndarray,
    panels: np.ndarray,
    out: np.ndarray,
    *,
    threaded: bool | None = None,
) -> kernels.Call:
    """:func:`matmul` checked and bound to its arrays, not run: each call
    multiplies what ``x`` holds then."""
    _check_floats("x", x, None)
    _check_floats("panels", panels, None)
    count, size = panels.shape
    if size != PANEL * x.shape[1]:
        raise ValueError(
            f"x has {x.shape[1]} columns; the panels hold {size // PANEL} inputs"
        )
    _check_floats("out", out, (x.shape[0], out.shape[1]))
    if not PANEL * (count - 1) < out.shape[1] <= PANEL * count:
        raise ValueError(
            f"out has {out.shape[1]} columns; {count} panels hold "
            f"{PANEL * (count - 1) + 1} to {PANEL * count} outputs"
        )
    if x.shape[0] == 0:
        return _nothing, ()
    if x.shape[1] == 0:  # an empty sum
        return out.fill, (0.0,)
    if threaded is None:
        threaded = x.size * out.shape[1] >= _PARALLEL_MIN_WORK
    threads = kernels._threads
    if threaded and threads > 1 and count > 1:
        parts = min(threads, count)
        return kernels._threaded, (
            _matmul_parallel,
            _matmul_serial,
            (x, panels, out, parts),
        )
    return _matmul, (x, panels, out)


def _nothing() -> None:
    """The call of a matmul of no rows."""


def warm_up() -> None:
    """Compile (or load from numba's cache) both entries, at load; then free
    the IR numba keeps of them (:func:`kernels.release_linking_ir`)."""
    x = np.zeros((1, 16), np.float32)
    panels = np.zeros((2, 16 * PANEL), np.float32)
    out = np.empty((1, 2 * PANEL), np.float32)
    _matmul(x, panels, out)
    if kernels._threads > 1:
        kernels._threaded(_matmul_parallel, _matmul_serial, (x, panels, out, 2))
    kernels.release_linking_ir()
