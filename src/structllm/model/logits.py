"""Logit processing before sampling: allowed ids, logit bias, penalties and
the ``min_tokens`` mask (:func:`process_logits`), batched over the rows
that need each. Split from :mod:`structllm.model.sampler`, which applies
the grammar bitmask first and samples after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from structllm.model.sampler import SamplingRow

__all__ = ["process_logits"]

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


def process_logits(logits: F32, rows: Sequence[SamplingRow]) -> F32:
    """Allowed ids, logit bias, penalties and the ``min_tokens`` mask.

    Returns ``logits`` itself when no row needs any of them, else a copy.

    ``logits`` (N, V) is never modified. Penalties touch only the (row,
    token) pairs that occur, found with ``np.unique`` over flat indices.
    """
    vocab = logits.shape[1]
    pen = [i for i, r in enumerate(rows) if r.params.has_penalties]
    masked = [
        i
        for i, r in enumerate(rows)
        if len(r.output_token_ids) < r.params.min_tokens
        and (r.eos_token_ids or r.params.stop_token_ids)
    ]
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    allowed = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if not pen and not masked and not biased and not allowed:
        return logits
    x = logits.copy()
    flat = x.reshape(-1)  # (N * V,) view
    for i in allowed:
        ids = np.asarray(rows[i].params.allowed_token_ids, dtype=np.int64)
        keep = x[i, ids[ids < vocab]]
        x[i] = -np.inf
        x[i, ids[ids < vocab]] = keep
    for i in biased:
        pairs = [(t, b) for t, b in rows[i].params.logit_bias if t < vocab]
        if pairs:
            ids = np.array([t for t, _ in pairs], dtype=np.int64)
            x[i, ids] += np.array([b for _, b in pairs], dtype=np.float32)
    if pen:
        _penalise(flat, vocab, [rows[i] for i in pen], pen)
    if masked:
        drop = [
            i * vocab + t
            for i in masked
            for t in {*rows[i].eos_token_ids, *rows[i].params.stop_token_ids}
            if 0 <= t < vocab
        ]
        flat[drop] = -np.inf
    return x


def _penalise(
    flat: F32, vocab: int, rows: Sequence[SamplingRow], names: Sequence[int]
) -> None:
    """Apply repetition, frequency and presence penalties in place.

    ``flat`` is the (N * V,) batch; ``names`` are the rows' batch indices.
    """
    rep = np.array([r.params.repetition_penalty for r in rows], dtype=np.float32)
    freq = np.array([r.params.frequency_penalty for r in rows], dtype=np.float32)
    pres = np.array([r.params.presence_penalty for r in rows], dtype=np.float32)
    base = np.asarray(names, dtype=np.int64) * vocab  # (P,) row offsets in flat
    out_at, out_row = _flat_ids([r.output_token_ids for r in rows], vocab, names)
    if (rep != 1.0).any():
        prompt_at, prompt_row = _flat_ids(
            [r.prompt_token_ids for r in rows], vocab, names
        )
        seen, first = np.unique(
            np.concatenate([base[prompt_row] + prompt_at, base[out_row] + out_at]),
            return_index=True,
        )
        row = np.concatenate([prompt_row, out_row])[first]  # (S,) index into rows
        v = flat[seen]
        r = rep[row]
        flat[seen] = np.where(v > 0, v / r, v * r)
    if (freq != 0.0).any() or (pres != 0.0).any():
        out, first, count = np.unique(
            base[out_row] + out_at, return_index=True, return_counts=True
        )
        row = out_row[first]
        flat[out] -= freq[row] * count.astype(np.float32) + pres[row]


def _flat_ids(
    seqs: Sequence[Sequence[int]], vocab: int, names: Sequence[int]
) -> tuple[I64, I64]:
    """All token ids of ``seqs``, concatenated, with the sequence each came from."""
    arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in seqs]
    for name, a in zip(names, arrays, strict=True):
        if a.size and (a.min() < 0 or a.max() >= vocab):
            raise ValueError(f"row {name} has a token id outside [0, {vocab})")
    ids = np.concatenate([np.zeros(0, np.int64), *arrays])
    which = np.repeat(np.arange(len(arrays)), [a.size for a in arrays])
    return ids, which
