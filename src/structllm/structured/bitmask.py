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

#: int32 with the bit pattern of float32 -inf's sign and exponent (0xFF800000)
_NEG_INF_BITS = np.int32(-8388608)


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
    constrained requests pays for those rows only. Branch-free: the bits
    become ``0.0`` or ``-inf`` and are added (~0.3 ms for 16 x 32k).
    """
    if logits.ndim != 2 or bitmask.ndim != 2:
        raise ValueError("logits and bitmask must both be 2-D")
    width = logits.shape[1]
    count = len(rows) if rows is not None else logits.shape[0]
    if count > bitmask.shape[0]:
        raise ValueError(f"{count} rows to mask, bitmask has {bitmask.shape[0]}")
    words = np.ascontiguousarray(bitmask[:count], dtype="<i4")
    # (count, width) of 0/1; count= pads with zeros past the vocabulary
    allowed = np.unpackbits(
        words.view(np.uint8), axis=1, count=width, bitorder="little"
    )
    penalty = allowed.astype(np.int32)
    penalty -= 1  # 0 (allowed) or -1 (all bits set)
    penalty &= _NEG_INF_BITS  # 0 -> +0.0, -1 -> -inf
    if rows is None:
        logits += penalty.view(np.float32)
    else:
        index = np.asarray(rows, dtype=np.intp)
        if len(np.unique(index)) != len(index):
            raise ValueError(f"rows must be distinct, got {list(rows)}")
        logits[index] += penalty.view(np.float32)
