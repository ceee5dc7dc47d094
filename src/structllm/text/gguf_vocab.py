"""What llama.cpp's vocabulary code knows, for GGUF tokenizers.

The pre-tokenizers a ``gpt2`` vocabulary names in ``tokenizer.ggml.pre``
(the regular expressions of ``src/llama-vocab.cpp``), the texts of the
tokens llama.cpp ends generation on, GPT-2's byte alphabet, and
SentencePiece merges rebuilt from scores. Data and small pure functions;
:mod:`structllm.text.gguf_tokenizer` builds the tokenizer from them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Final

import attrs

__all__ = [
    "END_OF_GENERATION_TEXTS",
    "PRE_TOKENIZERS",
    "PreTokenizer",
    "byte_alphabet",
    "end_of_generation_ids",
    "merges_from_scores",
    "respell",
]


@attrs.frozen
class PreTokenizer:
    """How a ``gpt2`` vocabulary splits text before BPE (llama.cpp's
    ``llm_tokenizer_bpe`` for one ``LLAMA_VOCAB_PRE_TYPE_*``)."""

    #: applied in turn; each splits every piece into matches and the gaps
    regexes: tuple[str, ...]
    #: a piece that is itself a token is not merged (llama3, tekken)
    ignore_merges: bool = False
    #: llama.cpp's ``add_bos`` when the file has no ``add_bos_token`` key
    add_bos: bool = False


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tekken and gpt-4o as their tokenizer.json spell them; llama.cpp rewrites the
# \p{Lu}... classes as lookaheads its regex engine understands.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2_PRE = PreTokenizer((_GPT2,))
_STARCODER = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = PreTokenizer((_QWEN2,))


def _named(pre: PreTokenizer, *names: str) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names, pre)


#: ``tokenizer.ggml.pre`` values read, as llama.cpp's ``llama_vocab::load``
#: maps them to its ``LLAMA_VOCAB_PRE_TYPE_*``. A file without the key gets
#: "default", as in llama.cpp.
PRE_TOKENIZERS: Final[Mapping[str, PreTokenizer]] = {
    "default": _DEFAULT,
    **_named(
        _GPT2_PRE,
        "gpt-2",
        "phi-2",
        "mpt",
        "olmo",
        "jais",
        "exaone4",
        "trillion",
        "granite-docling",
        "gigachat",
        "a.x-4.0",
        "mellum",
    ),
    **_named(
        _STARCODER,
        "starcoder",
        "refact",
        "command-r",
        "smollm",
        "codeshell",
        "exaone",
        "minerva-7b",
        "mellum2",
    ),
    **_named(
        _LLAMA3_PRE,
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
    ),
    **_named(PreTokenizer((_LLAMA3,)), "dbrx", "smaug-bpe"),
    **_named(
        _QWEN2_PRE,
        "qwen2",
        "deepseek-r1-qwen",
        "kormo",
        "f2llmv2",
        "megrez",
        "stablelm2",
        "hunyuan",
        "solar-open",
    ),
    "qwen35": PreTokenizer((_QWEN35,)),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **_named(PreTokenizer((_GPT4O,)), "gpt-4o", "llama4", "kanana2", "talkie"),
    "deepseek-coder": PreTokenizer(
        ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
    ),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
}

# Tokens llama.cpp ends generation on by their text (llama_vocab::impl::load),
# less the fill-in-the-middle ones.
END_OF_GENERATION_TEXTS: Final = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "[e~[",
    }
)


@functools.cache
def byte_alphabet() -> dict[str, int]:
    """GPT-2's printable spelling of each byte, character to byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def respell(token: str) -> str:
    by_byte = {b: c for c, b in byte_alphabet().items()}
    return "".join(by_byte[b] for b in token.encode("utf-8"))


def merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float]
) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, the best-scoring result first
    (transformers' ``generate_merges``, which is llama.cpp's SentencePiece
    order: the pair whose concatenation scores highest merges first)."""
    ids = {token: i for i, token in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for token, score in zip(tokens, scores, strict=True):
        local = [
            (token[:k], token[k:], float(score))
            for k in range(1, len(token))
            if token[:k] in ids and token[k:] in ids
        ]
        local.sort(key=lambda m: (ids[m[0]], ids[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def end_of_generation_ids(tokens: Sequence[str]) -> set[int]:
    found = {t: i for i, t in enumerate(tokens) if t in END_OF_GENERATION_TEXTS}
    # llama.cpp's exceptions: gpt-oss and solar-open end a turn with <|end|>
    # but go on generating after it; gemma4's </s> is no end.
    if "<|end|>" in found and (
        {"<|return|>", "<|call|>"} <= found.keys()
        or {"<|calls|>", "<|flush|>"} <= found.keys()
    ):
        del found["<|end|>"]
    if "</s>" in found and "<|tool_response>" in found:
        del found["</s>"]
    return set(found.values())
