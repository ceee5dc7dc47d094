"""A model's token vocabulary as llguidance sees it: :class:`GrammarVocabulary`.

Built once per model, from ``tokenizer.json`` (any ``tokenizers`` model:
byte-level BPE, SentencePiece-style BPE with byte fallback, WordPiece) or
from structllm's :class:`~structllm.text.Tokenizer` objects, including the
built-in :class:`~structllm.text.ByteTokenizer`. Building one costs ~0.1-1 s
at 32k-152k tokens (llguidance walks the vocabulary into a token trie), so
it belongs in model loading, not in a request.

The vocabulary is immutable and safe to share between threads.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import attrs
import llguidance
import tokenizers

from structllm.text.byte_tokenizer import ByteTokenizer
from structllm.text.tokenizer import HFTokenizer, Tokenizer

__all__ = ["GrammarVocabulary"]


class _ByteTokens:
    """The duck-typed tokenizer llguidance's ``TokenizerWrapper`` reads."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.eos_token_id = min(tokenizer.eos_token_ids)
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [bytes([i]) for i in range(256)] + [
            tokenizer.id_to_piece(i).encode() for i in range(256, tokenizer.vocab_size)
        ]
        self.special_token_ids = sorted(tokenizer.all_special_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@attrs.frozen(eq=False)
class GrammarVocabulary:
    """The tokens a grammar matcher chooses from, and which of them end output.

    ``vocab_size`` is the tokenizer's, which sets the bitmask width; a
    model's logits may be wider (padded embedding rows) and
    :func:`~structllm.structured.matcher.apply_bitmask` forbids the ids past
    the tokenizer.
    """

    lltokenizer: llguidance.LLTokenizer = attrs.field(repr=False)
    vocab_size: int
    eos_token_ids: frozenset[int]

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Tokenizer, *, model_eos_token_ids: Iterable[int] = ()
    ) -> GrammarVocabulary:
        """The vocabulary of a structllm tokenizer (HF or the byte tokenizer).

        A grammar may end on the tokenizer's EOS tokens and on the model's
        (``config.json``'s ``eos_token_id``: the ids that stop generation,
        which some checkpoints name only there).
        """
        eos = frozenset(tokenizer.eos_token_ids) | frozenset(model_eos_token_ids)
        if isinstance(tokenizer, HFTokenizer):
            return cls._build(tokenizer.backend.to_str(), tokenizer.vocab_size, eos)
        if isinstance(tokenizer, ByteTokenizer):
            wrapper = llguidance.TokenizerWrapper(_ByteTokens(tokenizer))
            return cls._build(wrapper, tokenizer.vocab_size, eos)
        raise TypeError(
            f"structured output needs an HFTokenizer or the ByteTokenizer, "
            f"got {type(tokenizer).__name__}"
        )

    @classmethod
    def from_tokenizer_json(
        cls, path: str | Path, *, eos_token_ids: Iterable[int]
    ) -> GrammarVocabulary:
        """The vocabulary of a ``tokenizer.json`` file, with the given EOS ids."""
        text = Path(path).read_text(encoding="utf-8")
        n = tokenizers.Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
        return cls._build(text, n, frozenset(eos_token_ids))

    @classmethod
    def _build(
        cls,
        source: str | llguidance.TokenizerWrapper,
        tokenizer_size: int,
        eos_token_ids: frozenset[int],
    ) -> GrammarVocabulary:
        if not eos_token_ids:
            raise ValueError("a grammar vocabulary needs at least one EOS token id")
        lltok = llguidance.LLTokenizer(source, eos_token=sorted(eos_token_ids))
        if lltok.vocab_size != tokenizer_size:
            raise ValueError(
                f"llguidance sees {lltok.vocab_size} tokens where the tokenizer "
                f"has {tokenizer_size}"
            )
        return cls(lltok, lltok.vocab_size, eos_token_ids)

    @property
    def bitmask_width(self) -> int:
        """int32 words per row of a token bitmask: ``ceil(vocab_size / 32)``."""
        return (self.vocab_size + 31) // 32
