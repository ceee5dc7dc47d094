"""Per-request grammar state and the batched token mask.

A :class:`GrammarMatcher` follows one request's output through its grammar.
Each step the engine, for the batch's constrained rows,

1. fills a token bitmask (:func:`allocate_bitmask`, :func:`fill_bitmasks`):
   one row of ``ceil(V / 32)`` int32 words per request, bit ``j`` of word
   ``w`` set when token ``32 * w + j`` may come next;
2. applies it to the logits before sampling (:func:`apply_bitmask`), which
   sets every forbidden logit to ``-inf``;
3. feeds the sampled token back (:meth:`GrammarMatcher.accept_token`).

Speculative decoding proposes the tokens the grammar forces
(:meth:`GrammarMatcher.forced_tokens`), checks proposed tokens without
keeping them (:meth:`GrammarMatcher.validate_tokens`) and fills one row per verified
position (:meth:`GrammarMatcher.fill_draft_bitmask`): the matcher advances
through the proposals and rolls back, so it still follows the output alone.

EOS is allowed exactly when the output so far is a complete match. A
matcher is *terminated* once no other token can follow (the mask then
allows EOS alone) or once EOS was accepted: the request is done.

Threads: a matcher is used by one thread at a time (the step loop); nothing
here locks. Different matchers may be used in different threads.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import llguidance
import numpy as np
import numpy.typing as npt

from structllm.structured.bitmask import apply_bitmask
from structllm.structured.vocabulary import GrammarVocabulary

__all__ = [
    "GrammarMatcher",
    "allocate_bitmask",
    "apply_bitmask",
    "fill_bitmasks",
]


@attrs.define(eq=False)
class GrammarMatcher:
    """One request's position in its grammar. Build it with
    :meth:`~structllm.structured.CompiledGrammar.matcher`."""

    _matcher: llguidance.LLMatcher = attrs.field(repr=False, alias="matcher")
    vocabulary: GrammarVocabulary = attrs.field(repr=False)
    #: tokens accepted so far (what :meth:`rollback` can undo)
    num_tokens: int = attrs.field(init=False, default=0)
    #: the position (in tokens) just after the accepted EOS, if one was
    _eos_at: int | None = attrs.field(init=False, default=None, repr=False)

    def accept_token(self, token_id: int) -> bool:
        """Advance by *token_id*; False (and no change) if the grammar forbids it.

        A token from a masked sample is always allowed; False therefore
        means the mask was not applied, or a stop token id was sampled that
        the grammar does not know as EOS.
        """
        return self.accept_tokens([token_id]) == 1

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance by as many of *token_ids* as the grammar allows, in order.

        Returns how many were accepted: a prefix of *token_ids* (for
        speculative decoding, the accepted draft length). An EOS is accepted
        when the output is complete, and nothing after it.
        """
        if self._eos_at is not None:
            return 0
        ids = list(token_ids)
        eos = self.vocabulary.eos_token_ids
        # EOS never reaches llguidance: whether it counts as a token there
        # depends on the parser state, which would break rollback
        end = next((i for i, t in enumerate(ids) if t in eos), len(ids))
        n: int = self._matcher.try_consume_tokens(ids[:end]) if end else 0
        if n == end < len(ids) and self._matcher.is_accepting():
            n += 1
            self._eos_at = self.num_tokens + n
        self.num_tokens += n
        return n

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of *token_ids*, in order, the grammar would accept (as
        :meth:`accept_tokens`), leaving the matcher as it was."""
        n = self.accept_tokens(token_ids)
        self.rollback(n)
        return n

    def forced_tokens(self) -> list[int]:
        """The tokens every match continues with from here (llguidance's
        fast-forward tokens: the tokenizer's tokens for the bytes the
        grammar forces, the last held back where a longer token could
        still cover it); empty where the next token is free or the output
        is done. The model may spell the same bytes with other tokens, so
        these are guesses for speculative decoding, never outputs."""
        if self._eos_at is not None or self._matcher.is_stopped():
            return []
        return list(self._matcher.compute_ff_tokens())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last *num_tokens* accepted tokens (preemption, drafts)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(
                f"can roll back 0..{self.num_tokens} tokens, got {num_tokens}"
            )
        in_grammar = num_tokens
        if self._eos_at is not None and self.num_tokens - num_tokens < self._eos_at:
            self._eos_at = None
            in_grammar -= 1
        if in_grammar and not self._matcher.rollback(in_grammar):
            raise RuntimeError(f"llguidance refused to roll back: {self.error}")
        self.num_tokens -= num_tokens

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self.rollback(self.num_tokens)

    def is_terminated(self) -> bool:
        """No token but EOS can follow, or EOS was accepted: the output is done."""
        return self._eos_at is not None or bool(self._matcher.is_stopped())

    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed now)."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str | None:
        """llguidance's message if the matcher broke (a resource limit), else None."""
        return self._matcher.get_error() if self._matcher.is_error() else None

    def fill_bitmask(self, bitmask: npt.NDArray[np.int32], row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``."""
        target = bitmask[row]
        if target.shape != (self.vocabulary.bitmask_width,) or not (
            target.flags.c_contiguous and target.dtype == np.int32
        ):
            raise ValueError(
                f"bitmask rows must be contiguous int32 of "
                f"{self.vocabulary.bitmask_width} words, got {target.dtype} "
                f"{target.shape}"
            )
        if self._eos_at is not None:  # done: EOS alone, as llguidance does
            words = target.view(np.uint32)
            words[:] = 0
            for token in self.vocabulary.eos_token_ids:
                words[token // 32] |= np.uint32(1 << (token % 32))
            return
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    def fill_draft_bitmask(
        self, draft_token_ids: Sequence[int], bitmask: npt.NDArray[np.int32], row: int
    ) -> None:
        """Rows ``row .. row + len(draft_token_ids)`` of ``bitmask``: the
        tokens allowed after the accepted ones and ``draft_token_ids[:j]``.

        The matcher advances through the proposals and rolls back, so it is
        left as it was. Past a proposal the grammar refuses, rows allow
        every token: verification never reaches them (that proposal is
        masked out at its own row, so it cannot be accepted).
        """
        self.fill_bitmask(bitmask, row)
        n = 0
        try:
            for j, token in enumerate(draft_token_ids, start=1):
                if not self.accept_token(token):
                    bitmask[row + j : row + len(draft_token_ids) + 1] = -1
                    break
                n += 1
                self.fill_bitmask(bitmask, row + j)
        finally:
            self.rollback(n)


def allocate_bitmask(
    batch_size: int, vocabulary: GrammarVocabulary
) -> npt.NDArray[np.int32]:
    """A ``(batch_size, ceil(V / 32))`` int32 bitmask allowing every token."""
    return np.full((batch_size, vocabulary.bitmask_width), -1, dtype=np.int32)


def fill_bitmasks(
    matchers: Sequence[GrammarMatcher | None], bitmask: npt.NDArray[np.int32]
) -> None:
    """Fill row ``i`` of *bitmask* for ``matchers[i]``; a None row allows all.

    Sequential on purpose: llguidance's ``LLExecutor`` fills rows in a
    thread pool, but on a small shared CPU the hand-off cost more than the
    fills (0.55 vs 0.40 ms for 16 rows at 32k; 3.0 vs 0.44 at 152k).
    """
    if len(matchers) > bitmask.shape[0]:
        raise ValueError(
            f"{len(matchers)} matchers for a bitmask of {bitmask.shape[0]} rows"
        )
    for row, matcher in enumerate(matchers):
        if matcher is None:
            bitmask[row] = -1
        else:
            matcher.fill_bitmask(bitmask, row)
