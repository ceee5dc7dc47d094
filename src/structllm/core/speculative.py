"""Proposers for speculative decoding: tokens a request will likely generate next.

A proposer guesses; it never decides. The scheduler runs a decoding
request's guesses as extra query positions of its step, and the sampler
keeps the longest prefix of them that the model itself would have generated
(:meth:`structllm.model.sampler.Sampler.verify`), so a wrong guess costs
compute, never a different output.

:func:`propose_ngram` is prompt lookup (vLLM's ``"ngram"`` method): output
that repeats its input (rewrites, summaries, code edits, JSON copying
fields) is predicted by the tokens that followed the same few tokens before.
Pure: a function of the request's tokens.

A draft model's proposals (``"draft_model"``) are
:class:`structllm.core.draft.DraftProposer`, which holds a KV cache of its
own and so lives beside the model runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from structllm.core.request import Request
from structllm.speculative_config import SpeculativeConfig

__all__ = ["NgramProposer", "Proposer", "propose_ngram"]


class Proposer(Protocol):
    """Proposes up to ``k`` tokens to follow ``request``'s tokens."""

    def propose(self, request: Request, k: int) -> Sequence[int]: ...


def propose_ngram(
    tokens: Sequence[int], k: int, *, min_n: int, max_n: int
) -> list[int]:
    """The continuation after the latest earlier match of the last n tokens.

    For ``n`` from ``max_n`` down to ``min_n``: find the last position where
    the final ``n`` tokens of ``tokens`` occur earlier (the occurrence that
    is the suffix itself does not count; an earlier one may overlap it) and
    return the ``k`` tokens that followed it, copying on into the proposal
    itself when the match is less than ``k`` tokens back (so a run that
    repeats with period ``p`` is proposed as repeating on). The first ``n``
    with a match wins; no match proposes nothing.
    """
    size = len(tokens)
    if k < 1 or size < 2 or min_n < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)  # (L,)
    # windows that end before the last token, so each has a continuation
    head = arr[:-1]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = arr[size - n :]  # (n,)
        windows = sliding_window_view(head, n)  # (L - n, n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            out: list[int] = arr[start : start + k].tolist()
            period = size - start  # the match's distance back, >= 1
            while len(out) < k:
                out.append(out[len(out) - period])
            return out
    return []


@attrs.frozen
class NgramProposer:
    """:func:`propose_ngram` over a request's prompt and output so far."""

    min_n: int
    max_n: int

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> NgramProposer:
        """The ``"ngram"`` method's bounds (both set once the config is built)."""
        low, high = config.prompt_lookup_min, config.prompt_lookup_max
        if low is None or high is None:
            raise ValueError(f"method {config.method!r} has no prompt lookup bounds")
        return cls(low, high)

    def propose(self, request: Request, k: int) -> list[int]:
        tokens = [*request.prompt_token_ids, *request.output_token_ids]
        return propose_ngram(tokens, k, min_n=self.min_n, max_n=self.max_n)
