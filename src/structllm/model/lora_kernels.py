"""The gathered low-rank product of LoRA, compiled by numba.

``add_lora`` adds to each row of a projection's output the update of the
adapter slot that row names (punica's BGMV, vLLM's ``lora/ops``): a step's
rows may each apply a different adapter, or none, in one call a
projection, whatever the mix. For row ``t`` of slot ``s``, and each piece
``p`` of the fused projection the adapter targets (its rank rows ``r0:r1``
of the slot's stacked A and B, its output columns ``c0:c1``)::

    u = a[s, r0:r1] @ x[t]                # (r,)  x's projection onto A
    y[t, c0:c1] += u @ b[s, r0:r1, c0:c1]  # (c1 - c0,) the scale is in b

The A rows are read whole (a dot product over the inputs, contiguous), the
B rows only across their piece's columns (an axpy a rank row, contiguous):
a fused q/k/v adapter costs its pieces' ranks times ``in`` plus each
piece's rank times that piece's width, never the zeros between pieces.

The conventions are ``kernels.py``'s: float32 numpy views of host tensors,
``fastmath`` (sums reassociated, vectorised), the GIL released, rows spread
over the threads of :func:`kernels.set_num_threads` when a call is big
enough to pay for the hand-off, and the compiled code cached on disk.
"""

from __future__ import annotations

import numpy as np

from structllm.model import kernels

__all__ = ["add_lora", "available", "warm_up"]

_jit = kernels._jit
_prange = kernels._prange

#: below this many multiply-adds a call runs on the calling thread
_PARALLEL_MIN_WORK = 1 << 18


def available() -> bool:
    """Whether the kernel can run (numba imported)."""
    return kernels.available()


@_jit()
def _lora_row(
    t: int,
    x: np.ndarray,  # (T, in)
    rows: np.ndarray,  # (T,) int64: a slot, or -1
    a: np.ndarray,  # (L, W, in)
    b: np.ndarray,  # (L, W, out)
    spans: np.ndarray,  # (L, P, 4) int64: r0, r1, c0, c1 per piece
    y: np.ndarray,  # (T, out), added to
) -> None:  # pragma: no cover - compiled
    s = rows[t]
    if s < 0:
        return
    n_in = x.shape[1]
    xt = x[t]
    u = np.empty(a.shape[1], np.float32)
    for p in range(spans.shape[1]):
        r0, r1 = spans[s, p, 0], spans[s, p, 1]
        if r0 == r1:
            continue
        c0, c1 = spans[s, p, 2], spans[s, p, 3]
        for j in range(r0, r1):
            aj = a[s, j]
            acc = np.float32(0.0)
            for i in range(n_in):
                acc += xt[i] * aj[i]
            u[j] = acc
        # slices from 0: numba vectorises a loop whose index it knows is
        # non-negative (see kernels._softmax_row)
        yt = y[t, c0:c1]
        for j in range(r0, r1):
            bj = b[s, j, c0:c1]
            uj = u[j]
            for c in range(c1 - c0):
                yt[c] += uj * bj[c]


# a serial and a parallel entry point, each its own function (kernels.py:
# numba's disk cache keys compiled code by function and signature)


@_jit()
def _add_lora(
    x: np.ndarray,
    rows: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    spans: np.ndarray,
    y: np.ndarray,
) -> None:  # pragma: no cover - compiled
    for t in range(x.shape[0]):
        _lora_row(t, x, rows, a, b, spans, y)


@_jit(parallel=True)
def _add_lora_parallel(
    x: np.ndarray,
    rows: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    spans: np.ndarray,
    y: np.ndarray,
) -> None:  # pragma: no cover - compiled
    for t in _prange(x.shape[0]):
        _lora_row(t, x, rows, a, b, spans, y)


def add_lora(
    x: np.ndarray,
    rows: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    spans: np.ndarray,
    y: np.ndarray,
    *,
    width: int | None = None,
    threaded: bool | None = None,
) -> np.ndarray:
    """``y[t] += x[t]``'s update under slot ``rows[t]`` (none for -1), in
    place; returns ``y``.

    ``x (T, in)`` and ``y (T, out)`` are float32 (``y`` written, so a
    tensor's own memory); ``a (L, W, in)`` and ``b (L, W, out)`` float32,
    C-contiguous, the slots' stacked A rows and scaled B rows; ``spans (L,
    P, 4)`` int64, each slot's pieces (rank rows ``r0:r1``, output columns
    ``c0:c1``; ``r0 == r1`` where the adapter leaves a piece alone). The
    caller checks that ``rows`` name slots below ``L`` and that the spans
    stay inside ``W`` and ``out``: the kernel reads unchecked. ``width``
    (the widest slot's rank rows) sizes the work for the threading choice;
    ``threaded`` forces it.
    """
    t_len = x.shape[0]
    if y.shape[0] != t_len or rows.shape != (t_len,):
        raise ValueError(f"x {x.shape}, y {y.shape} and rows {rows.shape} disagree")
    if (
        a.shape[:2] != b.shape[:2]
        or a.shape[2] != x.shape[1]
        or b.shape[2] != (y.shape[1])
    ):
        raise ValueError(f"a {a.shape} and b {b.shape} for x {x.shape}, y {y.shape}")
    for name, arr in (("x", x), ("y", y), ("a", a), ("b", b)):
        if arr.dtype != np.float32:
            raise ValueError(f"{name} must be float32, not {arr.dtype}")
    if rows.dtype != np.int64 or spans.dtype != np.int64:
        raise ValueError("rows and spans must be int64")
    if threaded is None:
        w = a.shape[1] if width is None else width
        threaded = t_len * w * (x.shape[1] + y.shape[1]) >= _PARALLEL_MIN_WORK
    args = (x, rows, a, b, spans, y)
    if threaded and kernels._threads > 1 and t_len > 1:
        kernels._threaded(_add_lora_parallel, _add_lora, args)
    else:
        _add_lora(*args)
    return y


def warm_up() -> None:
    """Compile the kernel (or load it from the disk cache) for the float32
    arrays a model passes, and its threaded entry when there are threads."""
    if not available():  # pragma: no cover
        return
    x = np.zeros((1, 2), np.float32)
    rows = np.zeros(1, np.int64)
    a = np.zeros((1, 1, 2), np.float32)
    spans = np.array([[[0, 1, 0, 2]]], np.int64)
    add_lora(x, rows, a, a.copy(), spans, x.copy(), threaded=False)
    if kernels._threads > 1:
        add_lora(x, rows, a, a.copy(), spans, x.copy(), threaded=True)
