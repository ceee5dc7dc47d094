"""The gathered low-rank product of LoRA, compiled by numba.

``add_lora`` adds to each row of a projection's output the update of the
adapter slot that row names (punica's BGMV, vLLM's ``lora/ops``): a step's
rows may each apply a different adapter, or none, in one call a
projection, whatever the mix. The rows on a slot go in tiles of four
(:func:`tiles_for`, once a step), so each A and B row is read from memory
once for four rows. For row ``t`` of slot ``s``, and each piece ``p`` of
the fused projection the adapter targets (its rank rows ``r0:r1`` of the
slot's stacked A and B, its output columns ``c0:c1``)::

    u = a[s, r0:r1] @ x[t]                # (r,)  x's projection onto A
    y[t, c0:c1] += u @ b[s, r0:r1, c0:c1]  # (c1 - c0,) the scale is in b

The A rows are read whole (a dot product over the inputs, contiguous), the
B rows only across their piece's columns (an axpy a rank row, contiguous):
a fused q/k/v adapter costs its pieces' ranks times ``in`` plus each
piece's rank times that piece's width, never the zeros between pieces.

The conventions are ``kernels.py``'s: float32 numpy views of host tensors,
``fastmath`` (sums reassociated, vectorised), the GIL released, tiles spread
over the threads of :func:`kernels.set_num_threads` when a call is big
enough to pay for the hand-off, and the compiled code cached on disk.
"""

from __future__ import annotations

import numpy as np

from structllm.model import kernels

__all__ = ["TILE", "add_lora", "available", "check", "tiles_for", "warm_up"]

_jit = kernels._jit
_prange = kernels._prange

#: below this many multiply-adds a call runs on the calling thread
_PARALLEL_MIN_WORK = 1 << 18


def available() -> bool:
    """Whether the kernel can run (numba imported)."""
    return kernels.available()


#: rows a tile: their A and B rows are read once for all of them
TILE = 4


def tiles_for(rows: np.ndarray) -> np.ndarray:
    """The rows of each slot in tiles: ``(n, 2 + TILE)`` int64, each
    ``slot, count, row...`` (unused places repeat the first row); rows on
    -1 are in none. Computed once a step, for every projection."""
    order = np.argsort(rows, kind="stable")
    order = order[rows[order] >= 0]
    tiles: list[list[int]] = []
    start = 0
    while start < order.size:
        slot = int(rows[order[start]])
        stop = start
        while stop < order.size and rows[order[stop]] == slot and stop - start < TILE:
            stop += 1
        members = [int(t) for t in order[start:stop]]
        tiles.append(
            [slot, len(members), *members, *[members[0]] * (TILE - len(members))]
        )
        start = stop
    return np.array(tiles, np.int64).reshape(-1, 2 + TILE)


@_jit()
def _lora_tile(
    k: int,
    x: np.ndarray,  # (T, in)
    tiles: np.ndarray,  # (n, 2 + TILE) int64: slot, count, rows
    a: np.ndarray,  # (L, W, in)
    b: np.ndarray,  # (L, W, out)
    spans: np.ndarray,  # (L, P, 4) int64: r0, r1, c0, c1 per piece
    y: np.ndarray,  # (T, out), added to
) -> None:  # pragma: no cover - compiled
    s, count = tiles[k, 0], tiles[k, 1]
    x0, x1, x2, x3 = x[tiles[k, 2]], x[tiles[k, 3]], x[tiles[k, 4]], x[tiles[k, 5]]
    n_in = x.shape[1]
    u = np.empty((TILE, a.shape[1]), np.float32)
    for p in range(spans.shape[1]):
        r0, r1 = spans[s, p, 0], spans[s, p, 1]
        if r0 == r1:
            continue
        c0, c1 = spans[s, p, 2], spans[s, p, 3]
        # each A row once for the tile's four dot products
        for j in range(r0, r1):
            aj = a[s, j]
            acc0 = acc1 = acc2 = acc3 = np.float32(0.0)
            for i in range(n_in):
                w = aj[i]
                acc0 += x0[i] * w
                acc1 += x1[i] * w
                acc2 += x2[i] * w
                acc3 += x3[i] * w
            u[0, j], u[1, j], u[2, j], u[3, j] = acc0, acc1, acc2, acc3
        # each B row's piece read from memory once, then from L1 per row;
        # slices from 0: numba vectorises a loop whose index it knows is
        # non-negative
        if count == TILE:
            y0, y1 = y[tiles[k, 2], c0:c1], y[tiles[k, 3], c0:c1]
            y2, y3 = y[tiles[k, 4], c0:c1], y[tiles[k, 5], c0:c1]
            for j in range(r0, r1):
                bj = b[s, j, c0:c1]
                u0, u1, u2, u3 = u[0, j], u[1, j], u[2, j], u[3, j]
                for c in range(c1 - c0):
                    w = bj[c]
                    y0[c] += u0 * w
                    y1[c] += u1 * w
                    y2[c] += u2 * w
                    y3[c] += u3 * w
            continue
        for q in range(count):
            yq = y[tiles[k, 2 + q], c0:c1]
            for j in range(r0, r1):
                bj = b[s, j, c0:c1]
                uj = u[q, j]
                for c in range(c1 - c0):
                    yq[c] += uj * bj[c]


# a serial and a parallel entry point, each its own function (kernels.py:
# numba's disk cache keys compiled code by function and signature)


@_jit()
def _add_lora(
    x: np.ndarray,
    tiles: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    spans: np.ndarray,
    y: np.ndarray,
) -> None:  # pragma: no cover - compiled
    for k in range(tiles.shape[0]):
        _lora_tile(k, x, tiles, a, b, spans, y)


@_jit(parallel=True)
def _add_lora_parallel(
    x: np.ndarray,
    tiles: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    spans: np.ndarray,
    y: np.ndarray,
) -> None:  # pragma: no cover - compiled
    for k in _prange(tiles.shape[0]):
        _lora_tile(k, x, tiles, a, b, spans, y)


def check(
    x: np.ndarray,
    tiles: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    spans: np.ndarray,
    y: np.ndarray,
) -> None:
    """Raise ValueError, naming the argument, unless :func:`add_lora` can
    take these arrays (the slot numbers and spans are the caller's)."""
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"x {x.shape} and y {y.shape} disagree")
    if tiles.ndim != 2 or tiles.shape[1] != 2 + TILE or tiles.dtype != np.int64:
        raise ValueError(f"tiles must be int64 (n, {2 + TILE}), not {tiles.shape}")
    if (
        a.shape[:2] != b.shape[:2]
        or a.shape[2] != x.shape[1]
        or b.shape[2] != (y.shape[1])
    ):
        raise ValueError(f"a {a.shape} and b {b.shape} for x {x.shape}, y {y.shape}")
    for name, arr in (("x", x), ("y", y), ("a", a), ("b", b)):
        if arr.dtype != np.float32:
            raise ValueError(f"{name} must be float32, not {arr.dtype}")
    if spans.dtype != np.int64 or spans.shape[0] != a.shape[0]:
        raise ValueError(f"spans must be int64 ({a.shape[0]}, P, 4)")


def add_lora(
    x: np.ndarray,
    tiles: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    spans: np.ndarray,
    y: np.ndarray,
    *,
    threaded: bool | None = None,
    checked: bool = False,
) -> np.ndarray:
    """``y[t] += x[t]``'s update under its slot, for the rows of ``tiles``
    (:func:`tiles_for` of each row's slot), in place; returns ``y``.

    ``x (T, in)`` and ``y (T, out)`` are float32 (``y`` written, so a
    tensor's own memory); ``a (L, W, in)`` and ``b (L, W, out)`` float32,
    C-contiguous, the slots' stacked A rows and scaled B rows; ``spans (L,
    P, 4)`` int64, each slot's pieces (rank rows ``r0:r1``, output columns
    ``c0:c1``; ``r0 == r1`` where the adapter leaves a piece alone). The
    kernel reads unchecked: the caller keeps the tiles' rows under ``T``
    and slots under ``L``, the spans inside ``W`` and ``out``; ``checked``
    says it has run :func:`check` on arrays of these shapes already (a
    projection's call in the middle of a step). ``threaded`` forces the
    threading choice.
    """
    if not checked:
        check(x, tiles, a, b, spans, y)
    if threaded is None:
        work = tiles.shape[0] * TILE * a.shape[1] * (x.shape[1] + y.shape[1])
        threaded = work >= _PARALLEL_MIN_WORK
    args = (x, tiles, a, b, spans, y)
    if threaded and kernels._threads > 1 and tiles.shape[0] > 1:
        kernels._threaded(_add_lora_parallel, _add_lora, args)
    else:
        _add_lora(*args)
    return y


def warm_up() -> None:
    """Compile the kernel (or load it from the disk cache) for the float32
    arrays a model passes, and its threaded entry when there are threads;
    then free the IR numba keeps of it (:func:`kernels.release_linking_ir`)."""
    if not available():  # pragma: no cover
        return
    x = np.zeros((1, 2), np.float32)
    tiles = tiles_for(np.zeros(1, np.int64))
    a = np.zeros((1, 1, 2), np.float32)
    spans = np.array([[[0, 1, 0, 2]]], np.int64)
    add_lora(x, tiles, a, a.copy(), spans, x.copy(), threaded=False)
    if kernels._threads > 1:
        add_lora(x, tiles, a, a.copy(), spans, x.copy(), threaded=True)
    kernels.release_linking_ir()
