"""Apply a token bitmask to a batch of logits: :func:`apply_bitmask`.

numpy only (no grammar library), so the sampler (``structllm.model``) can
mask logits without loading llguidance. The bitmask layout is the one
:mod:`~structllm.structured.matcher` fills: one row of ``ceil(V / 32)``
int32 words per request, bit ``j`` of word ``w`` set when token
``32 * w + j`` is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["apply_bitmask"]

#: each byte value's 8 bits (little-endian order) as 0.0 (set) or -inf (clear)
_PENALTY = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"),
    np.float32(0.0),
    np.float32(-np.inf),
).astype(np.float32)  # (256, 8)


def apply_bitmask(
    logits: npt.NDArray[np.float32],
    bitmask: npt.NDArray[np.int32],
    rows: Sequence[int] | None = None,
) -> None:
    """Set the logits of forbidden tokens to ``-inf``, in place.

    *logits* is ``(B, V_model)`` float32 and may be wider than the
    vocabulary (padded embedding rows): those extra ids are forbidden.
    Without *rows*, bitmask row ``i`` applies to logits row ``i``; with
    *rows* (distinct indices), bitmask row ``i`` applies to logits row
    ``rows[i]`` and other rows are left alone, so a batch with a few
    constrained requests pays for those rows only.

    Branch-free, one row at a time: each mask byte becomes its eight
    ``0.0`` / ``-inf`` penalties through a 256-entry table (``np.take`` into
    a buffer that stays in cache) and the row adds them. 16 x 152k: 1.7 ms,
    where unpacking the bits to int32 and adding the whole batch at once
    took 4.7 ms (7.2 through a fancy-indexed row subset).
    """
    if logits.ndim != 2 or bitmask.ndim != 2:
        raise ValueError("logits and bitmask must both be 2-D")
    width = logits.shape[1]
    targets = range(logits.shape[0]) if rows is None else rows
    if len(targets) > bitmask.shape[0]:
        raise ValueError(f"{len(targets)} rows to mask, bitmask has {bitmask.shape[0]}")
    if rows is not None and len(set(rows)) != len(rows):
        raise ValueError(f"rows must be distinct, got {list(rows)}")
    words = np.ascontiguousarray(bitmask[: len(targets)], dtype="<i4")
    masks = words.view(np.uint8)  # (count, 4 * words) bytes, little-endian
    covered = min(width, masks.shape[1] * 8)  # ids the bitmask speaks for
    penalty = np.empty((masks.shape[1], 8), dtype=np.float32)
    flat = penalty.reshape(-1)[:covered]
    for i, row in enumerate(targets):
        np.take(_PENALTY, masks[i], axis=0, out=penalty)
        logits[row, :covered] += flat
        logits[row, covered:] = -np.inf  # past the vocabulary
